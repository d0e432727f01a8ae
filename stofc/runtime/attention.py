"""Sparse attention on the GPU through CuPy: ``AttentionOp(fmt, config, ...).run(q, k, v)``.

The op uploads the mask format once, compiles (lazily, cached) the kernel for
the GPU's architecture, and launches it on a given stream. Inputs are 4-D
arrays with any strides whose last dim is contiguous: ``layout="bshd"``
(``[B, S, H, D]``, e.g. slices of a packed ``[B, S, 3, H, D]`` QKV output, read
in place) or ``"bhsd"``. The output has q's logical shape, contiguous, unless
``out`` is given.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from stofc.errors import StofcError
from stofc.kernels.attention.config import (
    AttentionConfig,
    KernelSpec,
    attention_family,
    check_dtype,
    check_head_dim,
    prune,
)
from stofc.kernels.attention.render import compile_kernel
from stofc.masks.format import MaskFormat
from stofc.runtime import attention_ws  # noqa: F401  (registers the ws launch form)
from stofc.runtime.launches import Operands, View, launch_for
from stofc.runtime.module import BoundLaunch, LoadedKernel, _cupy, device_arch, load_kernel
from stofc.targets import GpuProfile, detect


@dataclass(frozen=True)
class _Views:
    batch: int
    seq: int
    heads: int
    strides: tuple[int, int, int]       # batch, seq, head (elements)


def _dtype_ok(dtype, want: str) -> bool:
    """fp16 arrays for float16; bfloat16 arrays (or their raw uint16 bits) for bfloat16."""
    if want == "float16":
        return dtype == np.float16
    return dtype.name == "bfloat16" or dtype == np.uint16


def _views(x, layout: str, what: str) -> _Views:
    if x.ndim != 4:
        raise StofcError(f"attention {what} must be 4-D ({layout}), got shape {tuple(x.shape)}",
                         hint="pass [B, S, H, D] (layout='bshd') or [B, H, S, D] (layout='bhsd')")
    item = x.dtype.itemsize
    st = [s // item for s in x.strides]
    if st[3] != 1:
        raise StofcError(f"attention {what}: the head dim must be contiguous (strides {st})",
                         hint="make the last dimension contiguous")
    if layout == "bshd":
        return _Views(x.shape[0], x.shape[1], x.shape[2], (st[0], st[1], st[2]))
    if layout == "bhsd":
        return _Views(x.shape[0], x.shape[2], x.shape[1], (st[0], st[2], st[1]))
    raise StofcError(f"unknown attention layout {layout!r}", hint="use 'bshd' or 'bhsd'")


class AttentionOp:
    """One compiled attention (mask format x kernel config x dtype x head_dim).

    The config's family (:func:`~stofc.kernels.attention.config.attention_family`) gives
    the kernel, its launch data (computed by the family once, as for the package) and its
    launch form (:mod:`stofc.runtime.launches`)."""

    def __init__(self, fmt: MaskFormat, config, dtype: str, head_dim: int,
                 profile: GpuProfile | None = None) -> None:
        config = getattr(config, "config", config)          # KernelChoice or AttentionConfig
        if not isinstance(config, AttentionConfig):
            raise TypeError("config must be an AttentionConfig or a KernelChoice")
        check_head_dim(head_dim)
        check_dtype(dtype)
        if config.tile != fmt.tile:
            raise StofcError(f"kernel tile {config.tile} differs from the mask format's tile {fmt.tile}",
                             hint="encode the mask with the kernel's tile")
        self.profile = profile or detect()
        reason = prune(config, head_dim, self.profile)
        if reason:
            raise StofcError(f"attention config {config.describe()} is invalid: {reason}",
                             hint="pick one from search_space()")
        self.fmt, self.config, self.dtype, self.head_dim = fmt, config, dtype, head_dim
        self.family = attention_family(config.kind)
        self.target = device_arch()
        cp = _cupy()
        self._cp = cp
        self._launch = launch_for(self)           # the family's launch data, uploaded
        self._dummy = cp.zeros(8, dtype=cp.float16 if dtype == "float16" else cp.uint16)
        self._dummy_words = cp.zeros(1, dtype=cp.uint64)
        self._kernels: dict[tuple[bool, bool, bool], tuple[LoadedKernel, ...]] = {}

    # ------------------------------------------------------------------ helpers
    @property
    def launch_data(self) -> Any:
        """The walk-list kernels' launch data (what the package's plan.bin holds), or None."""
        return getattr(self._launch, "data", None)

    @property
    def plan(self) -> Any:
        """The block-wise walk list (None for the row-wise kernel)."""
        return getattr(self.launch_data, "plan", None)

    @property
    def permutation(self) -> Any:
        """The residue permutation of queries and keys, if the config uses one."""
        return getattr(self.launch_data, "permutation", None)

    def spec(self, *, has_bias: bool, has_key_bits: bool, has_softcap: bool = False) -> KernelSpec:
        return KernelSpec(self.config, self.dtype, self.head_dim, has_bias, has_key_bits,
                          has_softcap)

    def _kernel(self, has_bias: bool, has_key_bits: bool,
                has_softcap: bool) -> tuple[LoadedKernel, ...]:
        """The kernels of one variant: the main one (with its dynamic shared memory), then
        the others its source defines (the ws kernel's combine)."""
        key = (has_bias, has_key_bits, has_softcap)
        if key not in self._kernels:
            spec = self.spec(has_bias=has_bias, has_key_bits=has_key_bits,
                             has_softcap=has_softcap)
            compiled = compile_kernel(spec, self.target)
            smem = self.family.dynamic_smem(self.config, self.head_dim)
            entries = self.family.entry_points(spec)
            blocks = self.family.shared_blocks_per_sm(self.config)
            self._kernels[key] = tuple(load_kernel(compiled, e, dynamic_smem=smem if i == 0 else 0,
                                                   shared_blocks=blocks if i == 0 else 1)
                                       for i, e in enumerate(entries))
        return self._kernels[key]

    # ------------------------------------------------------------------ run
    def run(self, q, k, v, out=None, *, layout: str = "bshd", seq_lens=None, key_mask=None,
            bias=None, scale: float | None = None, softcap: float = 0.0, stream=None):
        """Attention of ``q`` over ``k, v`` under the mask on ``stream``; returns ``out``.

        See :meth:`bind` for the arguments; ``run`` binds and launches once.
        """
        with stream if stream is not None else contextlib.nullcontext():
            bound = self.bind(q, k, v, out, layout=layout, seq_lens=seq_lens,
                              key_mask=key_mask, bias=bias, scale=scale, softcap=softcap)
        return bound.launch(stream)

    def bind(self, q, k, v, out=None, *, layout: str = "bshd", seq_lens=None, key_mask=None,
             bias=None, scale: float | None = None, softcap: float = 0.0) -> BoundLaunch:
        """Check and pack one launch; ``.launch(stream)`` runs it and returns ``out``.

        ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention: query head
        ``h`` reads K/V head ``h // (H / Hkv)``; K/V are never expanded);
        ``seq_lens`` int ``[B]`` and/or ``key_mask`` 0/1 ``[B, >=L]`` drop padding keys;
        ``bias`` ``[B|1, H|1, >=L, >=L]`` (q's dtype) is added to the scaled scores;
        ``scale`` defaults to ``1/sqrt(head_dim)``; ``softcap > 0`` soft-caps the scaled
        scores (``softcap * tanh(s / softcap)``, before bias and mask).
        """
        cp = self._cp
        q, k, v = (cp.asarray(x) for x in (q, k, v))
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not _dtype_ok(x.dtype, self.dtype):
                raise StofcError(f"attention {name} has dtype {x.dtype}, the op was built for {self.dtype}",
                                 hint=f"cast the inputs to {self.dtype}")
            if x.shape[-1] != self.head_dim:
                raise StofcError(f"attention {name} has head_dim {x.shape[-1]}, the op was built for {self.head_dim}",
                                 hint="build the op for this head_dim")
        vq, vk, vv = _views(q, layout, "q"), _views(k, layout, "k"), _views(v, layout, "v")
        if not ((vq.batch, vq.seq) == (vk.batch, vk.seq) == (vv.batch, vv.seq)
                and vk.heads == vv.heads and vk.heads >= 1 and vq.heads % vk.heads == 0):
            raise StofcError("attention q, k, v shapes differ",
                             hint="pass q, k, v with the same batch and length, and k, v with "
                                  "a number of heads that divides q's (grouped-query attention)")
        batch, seq, heads = vq.batch, vq.seq, vq.heads
        kv_group = heads // vk.heads
        softcap = float(softcap)
        if not (softcap >= 0.0 and math.isfinite(softcap)):
            raise StofcError(f"attention softcap must be finite and >= 0, got {softcap}",
                             hint="pass 0 for no soft-capping")
        if seq > self.fmt.seq_len or seq < 1:
            raise StofcError(f"sequence length {seq} exceeds the mask's L_max {self.fmt.seq_len}",
                             hint="compile the mask for a larger --max-seq-len")
        if self.fmt.num_heads not in (1, heads):
            raise StofcError(f"the mask has {self.fmt.num_heads} per-head layouts, the input {heads} heads",
                             hint="encode the mask for the model's number of heads")
        for name, x, vw in (("q", q, vq), ("k", k, vk), ("v", v, vv)):
            if x.data.ptr % 16 or any(s % 8 for s in vw.strides):
                raise StofcError(f"attention {name} is not 16-byte aligned (strides {vw.strides})",
                                 hint="use strides that are multiples of 8 elements")
        if out is None:
            out = cp.empty(q.shape, dtype=q.dtype)
        vo = _views(out, layout, "out")
        if (vo.batch, vo.seq, vo.heads) != (batch, seq, heads) or out.dtype != q.dtype:
            raise StofcError("attention out has the wrong shape or dtype", hint="pass out like q")

        kv_len = cp.full((batch,), seq, dtype=cp.int32)
        if seq_lens is not None:
            sl = cp.asarray(seq_lens).astype(cp.int32).ravel()
            if sl.shape != (batch,):
                raise StofcError(f"seq_lens must have shape [{batch}]", hint="one length per sequence")
            kv_len = cp.minimum(kv_len, sl)
        key_words, words = 0, self._dummy_words
        if key_mask is not None:
            km = cp.asarray(key_mask)
            if km.ndim != 2 or km.shape[0] != batch or km.shape[1] < seq:
                raise StofcError(f"key_mask must be [B={batch}, S>={seq}], got {tuple(km.shape)}",
                                 hint="pass the model's 0/1 attention_mask")
            bits = km[:, :seq] != 0
            last = cp.where(bits.any(axis=1), seq - cp.argmax(bits[:, ::-1], axis=1), 0)
            kv_len = cp.minimum(kv_len, last.astype(cp.int32))
            key_words = -(-seq // 64)
            padded = cp.zeros((batch, key_words * 64), dtype=cp.bool_)
            padded[:, :seq] = bits
            words = cp.packbits(padded.ravel(), bitorder="little").view(cp.uint64)  # [B*kw], row-major
        bias_arr, bsb, bsh, bsq = self._dummy, 0, 0, 0
        if bias is not None:
            bias_arr = cp.asarray(bias)
            if (bias_arr.ndim != 4 or bias_arr.dtype != q.dtype or bias_arr.shape[0] not in (1, batch)
                    or bias_arr.shape[1] not in (1, heads) or min(bias_arr.shape[2:]) < seq
                    or bias_arr.strides[3] != bias_arr.dtype.itemsize):
                raise StofcError(f"bias must be [B|1, H|1, >=L, >=L] of {self.dtype} with contiguous "
                                 f"last dim, got {tuple(bias_arr.shape)} {bias_arr.dtype}",
                                 hint="pass the additive bias in the model's layout and dtype")
            item = bias_arr.dtype.itemsize
            bsb = 0 if bias_arr.shape[0] == 1 else bias_arr.strides[0] // item
            bsh = 0 if bias_arr.shape[1] == 1 else bias_arr.strides[1] // item
            bsq = bias_arr.strides[2] // item
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        if not scale > 0:
            raise StofcError(f"attention scale must be > 0, got {scale}", hint="pass a positive scale")

        kernels = self._kernel(bias is not None, key_mask is not None, softcap > 0.0)
        return self._launch.bind(Operands(
            View(q, *_shape(vq)), View(k, *_shape(vk)), View(v, *_shape(vv)),
            View(out, *_shape(vo)), kv_len, key_words, words, bias_arr, (bsb, bsh, bsq), scale,
            kv_group, softcap, batch, heads, seq, kernels))


def _shape(vw: _Views) -> tuple[int, int, int, tuple[int, int, int]]:
    return vw.batch, vw.seq, vw.heads, vw.strides
