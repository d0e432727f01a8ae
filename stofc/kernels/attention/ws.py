"""The warp-specialised Hopper kernel (``kind="ws"``): its shape, resources and pruning.

``templates/attention/block_ws.cu.j2`` runs 384 threads: a producer warpgroup that
keeps 40 registers per thread and streams K/V with the Tensor Memory Accelerator,
and two consumer warpgroups that take 232 each (``setmaxnreg``), own 64 query rows
each and walk the pair rows of :mod:`.ws_plan`. Shared memory holds Q for 128 rows,
``stages`` K and V tiles of 64 keys (128-byte swizzled panels), two part-tile
bitmaps per stage and the ring's mbarriers. One block per SM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stofc.targets import GpuProfile

if TYPE_CHECKING:  # annotations only: config imports this module
    from stofc.kernels.attention.config import AttentionConfig

WS_CC = (9, 0)                 # setmaxnreg, wgmma and the TMA path: sm_90a only
WS_HEAD_DIMS = (64, 128, 256)  # whole 128-byte swizzle panels
WS_TILE = 64
WS_WARPS = 12                  # producer + two consumer warpgroups
WS_STAGES = (2, 3, 4)
PRODUCER_REGS = 40
CONSUMER_REGS = 232
MAX_CHUNKS = 64                # chunks of one split pair row the combine kernel merges
SPLITS = (0, 8, 16, 32, 64)    # search-space values of ``split`` (tiles per chunk)
KSTEPS = (1, 2)                # 64-key tiles per softmax step
Q_REGS_MAX_HEAD_DIM = 128      # above, S = Q K^T reads Q from shared memory
REG_OVERHEAD = 40              # addresses, loop state, masks, softmax state


def ws_reg_split(kstep: int) -> tuple[int, int]:
    """(producer, consumer) registers per thread after ``setmaxnreg``: two 64-key tiles per
    step fit the same split once Q moves to shared memory (:func:`ws_q_in_regs`)."""
    return (PRODUCER_REGS, CONSUMER_REGS)


def ws_smem_bytes(stages: int, head_dim: int) -> int:
    """Dynamic shared memory of one block (the 1024 bytes of panel-alignment slack included)."""
    panels = head_dim // 64
    q = panels * 128 * 128
    kv = stages * 2 * panels * WS_TILE * 128
    bitmaps = stages * 2 * (WS_TILE // 8) ** 2 * 8
    barriers = (4 * stages + 2) * 8
    return q + kv + bitmaps + barriers + 1024


def ws_q_in_regs(head_dim: int, kstep: int = 1) -> bool:
    """Whether S = Q K^T reads Q's fragments from registers (else from smem panels): up
    to head_dim 128 with one tile per step, 64 with two (the O, S and P arrays of 128
    keys and head_dim 128 leave no room for Q: ptxas spilled 232 bytes)."""
    return head_dim <= (Q_REGS_MAX_HEAD_DIM if kstep == 1 else 64)


def ws_registers(head_dim: int, kstep: int = 1) -> int:
    """Registers a consumer thread's live arrays need: O, S and the held P fragments of
    ``kstep`` 64-key tiles, Q (if held in registers)."""
    acc = head_dim // 2
    s, p = 32 * kstep, 16 * kstep
    q = head_dim // 4 if ws_q_in_regs(head_dim, kstep) else 0
    return acc + s + p + q + REG_OVERHEAD


def ws_prune(c: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
    """Why ``c`` (kind ``ws``) cannot run on ``profile``; None if it can."""
    if profile.compute_capability != WS_CC:
        return "the warp-specialised kernel is Hopper-only (sm_90a: setmaxnreg, wgmma, TMA)"
    if head_dim not in WS_HEAD_DIMS:
        return "ws: head_dim must be 64, 128 or 256 (whole 128-byte swizzle panels)"
    if c.tile != WS_TILE:
        return "ws: a consumer warpgroup owns one 64-row tile row (mask tile 64)"
    if (c.warps, c.warp_m, c.q_split, c.min_blocks) != (WS_WARPS, 16, 1, 1):
        return "ws: 3 warpgroups (producer + 2 consumers), 64 rows each, one block per SM"
    if c.gather or c.permute:
        return "ws: the TMA producer loads contiguous 64-key tiles (no gathered or permuted walk)"
    if c.stages not in WS_STAGES:
        return "ws: stages must be 2..4 (the ring of K/V tiles)"
    if c.kstep not in KSTEPS:
        return "ws: a softmax step covers 1 or 2 tiles of 64 keys"
    if c.stages < 2 * c.kstep:
        return "ws: the ring must hold two steps (stages >= 2 x tiles per step) to load ahead"
    if c.split < 0 or (c.split and c.split < 8):
        return "ws: split is 0 (never) or at least 8 tiles per chunk"
    if c.mma != "wgmma":
        return "ws: the consumers use wgmma"
    smem = ws_smem_bytes(c.stages, head_dim)
    if smem > profile.smem_per_block:
        return f"needs {smem} B of shared memory, the GPU allows {profile.smem_per_block} per block"
    regs, cap = ws_registers(head_dim, c.kstep), ws_reg_split(c.kstep)[1]
    if regs > cap:
        return f"needs about {regs} registers per consumer thread (> {cap})"
    return None
