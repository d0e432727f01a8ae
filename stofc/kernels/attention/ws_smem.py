"""The shared-memory layout of one warp-specialised attention block (``block_ws.cu.j2``),
as the template lays it out: Q buffers, the K/V ring of 128-byte-swizzled 64-key tiles,
the part-tile bitmaps, the mbarriers, the ones the row sums read and, where it fits, the
area that stages O. The launch's dynamic shared memory is :func:`ws_smem_bytes`; the
template asserts that its regions fit in it."""

from __future__ import annotations

WS_TILE = 64
Q_REGS_MAX_HEAD_DIM = 128      # above, S = Q K^T reads Q from shared memory
SM90_SMEM_PER_BLOCK = 227 * 1024   # the opt-in limit of every sm_90 part (H100, H200, H800)
# shared memory the system reserves for each resident block (sm_80 on): blocks sharing an SM
# fit only if theirs and this together stay within the SM's
SMEM_RESERVED_PER_BLOCK = 1024


# A work as the producer resolved it, handed to the consumers beside its Q buffer (twelve
# int32: ``Work`` in the template). The consumers once resolved each work themselves (item
# order, item, key length and the walk's trim: dependent global loads) between works; traced
# on an H100 (bench/results/ws-trace-h100-2026-11-28-{before-records,records}.*), a work
# after the first now starts 0.3-0.6k cycles after the last one ended, not 1.0-1.2k.
WORK_RECORD_BYTES = 48


def _ring_bytes(stages: int, head_dim: int, consumers: int, q_bufs: int = 1) -> int:
    """Q panels (``q_bufs`` buffers), the K/V ring, the part-tile bitmaps, the mbarriers
    and the work records (one per Q buffer) of one block."""
    panels = head_dim // 64
    q = q_bufs * panels * WS_TILE * consumers * 128
    kv = stages * 2 * panels * WS_TILE * 128
    bitmaps = stages * consumers * (WS_TILE // 8) ** 2 * 8
    barriers = (4 * stages + 2 * q_bufs) * 8
    return q + kv + bitmaps + barriers + q_bufs * WORK_RECORD_BYTES


# The row sums of P (the softmax denominators) come from a wgmma of P against a 16 x 8 tile of
# ones in shared memory (ONES_BYTES after the mbarriers, 128-byte aligned: OFF_ONES in the
# template), issued with each step's P V, instead of ~2 FADDs per probability in the softmax
# (~30 of a consumer warp's ~340 instructions per 64-key step at head_dim 64;
# bench/results/ws-variants-rowsum-h100-2026-11-27.jsonl, NOTES.md).
WS_ROWSUM_MMA = True
ONES_BYTES = 256
# At head_dim 64 the sums ride in the P V GEMM itself: m64n72k16, whose ninth n8 block reads
# a 16-key panel of ones that every V slot's descriptor reaches through its leading byte
# offset (the stride to the next 64-column panel along N). That drops the four m64n8k16
# row-sum wgmma and their descriptor of each step (about 9 of a consumer warp's ~255
# instructions per 64-key step, which bound head_dim 64; ws-variants-rowsum-in-pv-*).
# head_dim 128 and 256 keep the separate wgmma: their V panels fill the leading byte offset.
ONES_PANEL_BYTES = 16 * 128


def ws_rowsum_in_pv(head_dim: int) -> bool:
    """Whether P's row sums come from the P V wgmma's extra eight columns (head_dim 64)."""
    return WS_ROWSUM_MMA and head_dim == 64


def ws_ones_bytes(head_dim: int) -> int:
    """The ones the row sums read: a 16-key x 64-column panel where the P V GEMM reads them
    (:func:`ws_rowsum_in_pv`), else one 16 x 8 K-major core pair."""
    return ONES_PANEL_BYTES if ws_rowsum_in_pv(head_dim) else ONES_BYTES


def _ones_end(stages: int, head_dim: int, consumers: int, q_bufs: int = 1) -> int:
    """The end of the ring and, 128-byte aligned after it, the row-sum operand's ones."""
    return (-(-_ring_bytes(stages, head_dim, consumers, q_bufs) // 128) * 128
            + ws_ones_bytes(head_dim))


def ws_stage_bytes(head_dim: int, consumers: int) -> int:
    """The output staging area: 16 rows of ``2 * head_dim + 16`` bytes per consumer warp
    (``staged_row_bytes`` in ``cuda/stofc/ws.cuh``)."""
    return consumers * 4 * 16 * (2 * head_dim + 16)


def ws_stage_o(stages: int, head_dim: int, consumers: int = 2) -> bool:
    """Whether O leaves through the staging area (``store_rows_staged``: stmatrix, then
    16-byte stores of whole sectors) rather than as 4-byte stores straight from the
    accumulators. ncu of local +-64 at head_dim 128 (``bench/results/ncu-ws-epilogue-*``)
    put 12-16% of the consumers' stall samples on those stores and the drain behind them.
    Taken wherever the area fits beside the ring (head_dim 64 and 128 but the four-stage
    ring of three consumers at 128); head_dim 256's ring leaves no room."""
    return _staged_bytes(stages, head_dim, consumers) + 1024 <= SM90_SMEM_PER_BLOCK


def _staged_bytes(stages: int, head_dim: int, consumers: int, q_bufs: int = 1) -> int:
    """The ring, the ones (:func:`_ones_end`), then the staging area (``OFF_O``)."""
    return _ones_end(stages, head_dim, consumers, q_bufs) + ws_stage_bytes(head_dim, consumers)


def _block_bytes(stages: int, head_dim: int, consumers: int, q_bufs: int) -> int:
    """One block's dynamic shared memory with ``q_bufs`` Q buffers, the alignment slack
    included (the staging area where :func:`ws_stage_o` takes it)."""
    if ws_stage_o(stages, head_dim, consumers):
        return _staged_bytes(stages, head_dim, consumers, q_bufs) + 1024
    return _ones_end(stages, head_dim, consumers, q_bufs) + 1024


def ws_q_buffers(stages: int, head_dim: int, consumers: int = 2, kstep: int = 1) -> int:
    """Q buffers of a block: two where S = Q K^T reads Q from shared memory and a second
    buffer fits beside the ring and the staging area, else one.

    With one buffer and Q in shared memory, the producer can load the next work's Q (and,
    behind it, that work's K/V) only once every warpgroup issued its last S of this work;
    a warpgroup whose own tile row ends the walk early (Longformer's and BigBird's pair
    rows: a third of the (entry, warpgroup) pairs skipped with four consumers) idles at
    every work boundary, and the next work's first S waits for a TMA round trip. Held in
    registers, Q is released as soon as it is read, so one buffer serves. A second buffer
    never costs a stage or the staging area (the search space decides those).

    Same call on an H100 (``bench/results/ws-variants-qbufs-h100-2026-11-27.jsonl``, four
    consumers, head_dim 64, H=12 at (1, 8192), (4, 4096), (1, 16384)): without turns,
    Longformer, BigBird and +-256 windows 0.8-2.7% faster than one buffer; with turns
    4.6-8.3% faster; dense and causal rows level within the run's noise (+-3%). Three
    consumers at head_dim 128 with two stages (``ws-variants-qbufs-d128-h100-2026-11-27.jsonl``,
    B=1 H=16 bf16 at 8K and 16K, dense, causal and causal window 4095): level within that
    run's noise (pairs from -5.4% to +2.4%, one causal outlier; the same config timed twice
    differed by 5%)."""
    if ws_q_in_regs(head_dim, kstep, consumers):
        return 1
    fits = _block_bytes(stages, head_dim, consumers, 2) <= SM90_SMEM_PER_BLOCK
    return 2 if fits else 1


def ws_smem_bytes(stages: int, head_dim: int, consumers: int = 2, kstep: int = 1) -> int:
    """Dynamic shared memory of one block (the 1024 bytes of panel-alignment slack
    included): the ring (:func:`_ring_bytes`, :func:`ws_q_buffers` Q buffers) and, where
    :func:`ws_stage_o` takes it, the output staging area after it."""
    q_bufs = ws_q_buffers(stages, head_dim, consumers, kstep)
    return _block_bytes(stages, head_dim, consumers, q_bufs)


def ws_q_in_regs(head_dim: int, kstep: int = 1, consumers: int = 2) -> bool:
    """Whether S = Q K^T reads Q's fragments from registers (else from smem panels): up
    to head_dim 128 with one tile per step and two consumer warpgroups; 64 with two tiles
    per step (the O, S and P arrays of 128 keys and head_dim 128 leave no room for Q:
    ptxas spilled 232 bytes) or three warpgroups (their 160 registers hold head_dim 128's
    O, S and P but not Q: ptxas spilled 100 bytes; with Q in shared memory the three run
    dense and causal rows 4-11% faster than two, bench/results/ws-variants-d128-c3-*).
    Four warpgroups' 112 registers never hold Q (head_dim 64 with Q: C7512, wgmma
    serialised for want of registers)."""
    if consumers >= 4:
        return False
    if kstep == 2 or consumers == 3:
        return head_dim <= 64
    return head_dim <= Q_REGS_MAX_HEAD_DIM
