"""Oracles for the attention kernels: a dense->MaskFormat converter and a float64 reference.

:func:`format_from_dense` builds a :class:`~stofc.masks.format.MaskFormat` from a
boolean ``[L, L]`` or ``[H, L, L]`` array by brute force, independently of the
mask encoder (tests compare the two). :func:`dense_from_format` inverts it.
:func:`reference_attention` is the semantics every kernel must match.
"""

from __future__ import annotations

import hashlib

import numpy as np

from stofc.kernels.attention.gather import pack_bits
from stofc.masks.format import MaskFormat


def format_from_dense(dense: np.ndarray, tile: int = 64) -> MaskFormat:
    """Encode a boolean mask ``[L, L]`` (shared) or ``[H, L, L]`` (per head). Vectorised."""

    dense = np.asarray(dense, dtype=bool)
    if dense.ndim == 2:
        dense = dense[None]
    heads, n, n2 = dense.shape
    if n != n2 or tile not in (16, 32, 64, 128):
        raise ValueError("dense mask must be [H?, L, L] and tile one of 16, 32, 64, 128")
    rows = -(-n // tile)
    pad = np.zeros((heads, rows * tile, rows * tile), dtype=bool)
    pad[:, :n, :n] = dense
    blocks = pad.reshape(heads, rows, tile, rows, tile).transpose(0, 1, 3, 2, 4)  # h,r,c,T,T
    hh, rr, cc = np.nonzero(blocks.any(axis=(3, 4)))                             # h, r, c order
    digest = hashlib.sha256(np.packbits(dense).tobytes() + f"{n}:{tile}".encode()).hexdigest()
    return format_from_tiles(heads, n, tile, hh, rr, cc, blocks[hh, rr, cc], digest=digest)


def format_from_tiles(heads: int, n: int, tile: int, hh: np.ndarray, rr: np.ndarray,
                      cc: np.ndarray, bits: np.ndarray, *, digest: str | None = None
                      ) -> MaskFormat:
    """Encode the nonempty tiles ``(hh, rr, cc)`` (any order) with their bool ``[T, T]``
    contents ``bits`` (positions past ``n`` False) as a format of ``L_max = n``;
    ``digest``: its ``spec_hash`` (default: a sha256 of the tiles)."""
    rows = -(-n // tile)
    hh, rr, cc = (np.asarray(x, dtype=np.int64) for x in (hh, rr, cc))
    order = np.lexsort((cc, rr, hh))
    hh, rr, cc, bits = hh[order], rr[order], cc[order], np.asarray(bits, dtype=bool)[order]
    cnt = bits.sum(axis=(1, 2), dtype=np.int64)
    span = np.minimum(tile, n - np.arange(rows) * tile)
    is_part = cnt < span[rr] * span[cc]
    ph, pr, pc = hh[is_part], rr[is_part], cc[is_part]
    words = pack_bits(bits[is_part]) if ph.size else np.zeros((0, (tile // 8) ** 2))
    load_part = np.full(hh.size, -1, dtype=np.int64)
    load_part[is_part] = np.arange(int(is_part.sum()))

    def ptr(h_of, r_of):
        per_row = np.bincount(h_of * rows + r_of, minlength=heads * rows)          # [h*r]
        out = np.concatenate([[0], np.cumsum(per_row)])                          # global
        return np.stack([out[h * rows:(h + 1) * rows + 1] for h in range(heads)])

    full = ~is_part
    if digest is None:
        digest = hashlib.sha256(np.stack([hh, rr, cc]).tobytes() + np.packbits(bits).tobytes()
                                + f"{n}:{tile}".encode()).hexdigest()

    def arr(x, dt):
        a = np.ascontiguousarray(np.asarray(x, dtype=dt))
        a.setflags(write=False)
        return a

    row_nnz = np.bincount(hh * rows + rr, weights=cnt, minlength=heads * rows)
    return MaskFormat(
        spec=f'{{"dense_oracle": "{digest[:16]}"}}', spec_hash=digest, seq_len=n, tile=tile,
        num_heads=heads,
        full_row_ptr=arr(ptr(hh[full], rr[full]), np.int32), full_col_idx=arr(cc[full], np.int32),
        part_row_ptr=arr(ptr(ph, pr), np.int32), part_col_idx=arr(pc, np.int32),
        part_bitmaps=arr(words, np.uint64),
        load_row_ptr=arr(ptr(hh, rr), np.int32), load_col_idx=arr(cc, np.int32),
        load_part_idx=arr(load_part, np.int32),
        row_nnz=arr(row_nnz.reshape(heads, rows).round(), np.int64),
        nnz=int(cnt.sum()),
    )


def dense_from_format(fmt: MaskFormat) -> np.ndarray:
    """The boolean ``[num_heads, L_max, L_max]`` mask a format encodes."""
    t, itn, n = fmt.tile, fmt.tile // 8, fmt.seq_len
    rows = fmt.tile_rows
    out = np.zeros((fmt.num_heads, rows * t, rows * t), dtype=bool)
    shifts = np.arange(64, dtype=np.uint64).reshape(8, 8)
    for h in range(fmt.num_heads):
        for r in range(rows):
            for j in range(fmt.load_row_ptr[h, r], fmt.load_row_ptr[h, r + 1]):
                c, p = int(fmt.load_col_idx[j]), int(fmt.load_part_idx[j])
                blk = out[h, r * t:(r + 1) * t, c * t:(c + 1) * t]
                if p < 0:
                    blk[:] = True
                    continue
                words = fmt.part_bitmaps[p]
                for ic in range(itn):
                    for ir in range(itn):
                        bits = (words[ic * itn + ir] >> shifts) & np.uint64(1)
                        blk[ir * 8:(ir + 1) * 8, ic * 8:(ic + 1) * 8] = bits.astype(bool)
    return out[:, :n, :n]


def key_valid(batch: int, seq_len: int, *, seq_lens=None, key_mask=None) -> np.ndarray:
    """Bool ``[B, L]``: which keys the runtime padding keeps (both inputs AND together)."""
    keep = np.ones((batch, seq_len), dtype=bool)
    if seq_lens is not None:
        keep &= np.arange(seq_len)[None, :] < np.asarray(seq_lens).reshape(batch, 1)
    if key_mask is not None:
        keep &= np.asarray(key_mask)[:, :seq_len] != 0
    return keep


def reference_attention(q, k, v, dense_mask, scale: float, *, seq_lens=None, key_mask=None,
                        bias=None, softcap: float = 0.0) -> np.ndarray:
    """float64 attention on ``[B, L, H, D]`` inputs; returns ``[B, L, H, D]`` float64.

    ``k``/``v`` may be ``[B, L, Hkv, D]`` with ``Hkv`` dividing H (grouped-query
    attention: head h reads K/V head ``h // (H // Hkv)``). ``dense_mask`` is bool
    ``[L_max, L_max]`` or ``[H, L_max, L_max]`` (top-left ``L x L`` corner used);
    ``seq_lens`` int ``[B]`` and ``key_mask`` 0/1 ``[B, >=L]`` drop keys; ``softcap > 0``
    maps the scaled scores to ``softcap * tanh(s / softcap)``; ``bias`` ``[B|1, H|1, L, L]``
    is then added. Rows with no allowed key are 0.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, n, heads, _ = q.shape
    if k.shape[2] != heads:                      # grouped-query attention: repeat K/V heads
        k = np.repeat(k, heads // k.shape[2], axis=2)
        v = np.repeat(v, heads // v.shape[2], axis=2)
    m = np.asarray(dense_mask, dtype=bool)
    m = (m[None] if m.ndim == 2 else m)[:, :n, :n]                       # [H|1, L, L]
    allowed = m[None] & key_valid(b, n, seq_lens=seq_lens, key_mask=key_mask)[:, None, None, :]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)[..., :n, :n]
    s = np.where(allowed, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.where(allowed, np.exp(s - mx), 0.0)
    den = p.sum(axis=-1, keepdims=True)
    p = p / np.where(den > 0, den, 1.0)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def to_bf16_bits(x) -> np.ndarray:
    """float array -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def from_bf16_bits(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
