"""The warp-specialised Hopper kernel (``kind="ws"``): its shape, resources and pruning.

``templates/attention/block_ws.cu.j2`` runs a producer warpgroup that keeps few
registers per thread and streams K/V with the Tensor Memory Accelerator, and one to
four consumer warpgroups (``warps`` 8, 12, 16 or 20) that take the rest (``setmaxnreg``:
40 / 232 with two, 32 / 160 with three, FlashAttention-3's split; 24 / 112 with four;
24 / 136 with one, whose blocks run three to an SM, :data:`~.ws_plan.WS_BLOCKS_PER_SM`),
own 64 query rows each and walk the pair rows of :mod:`.ws_plan`. Three consumers put
three warps of softmax on each scheduler instead of two (more latency hidden;
FlashAttention-3 runs head_dim 64 so); their 160 registers hold head_dim 64's arrays,
and head_dim 128's once Q is read from shared memory (:func:`ws_q_in_regs`; 256's are
pruned by :func:`ws_registers`). Four (head_dim 64 only, Q in shared memory) put four:
dense and causal rows ran 8-13% faster than three (H100,
``bench/results/ws-variants-c4-h100-2026-11-27.jsonl``); not with a bias (four spill then
and run slower: :func:`~.ws_cost.ws_spills`). One consumer (head_dim 64 only) walks its
own tile row with no union and no skipped step, three blocks an SM interleaving three
such walks: BigBird ran 11-22% faster than the best of two to four consumers, Longformer
5-12% at B=1, dense, causal and long windows 12-39% slower (H200,
``bench/results/ws-variants-c1x3-h200-2026-11-29.jsonl``; the cost model keeps it to the
masks it wins).
Shared memory holds Q for the block's
rows (two buffers where S reads Q from it and they fit: :func:`ws_q_buffers`), ``stages`` K and V
tiles of 64 keys (128-byte swizzled panels), one part-tile bitmap per consumer and
stage, the ring's mbarriers and, where it fits, an area that stages O for 16-byte
stores (:func:`ws_stage_o`). One block per SM, three with one consumer.

Registered as the family ``attention_ws`` (:class:`AttentionWs`). Its launch data is
the pair-row walk of :mod:`.ws_plan` (:class:`~.ws_launch.WsLaunchPlan`): the CuPy
runtime (:mod:`stofc.runtime.attention_ws`) uploads it and a package writes it as a
kind-2 ``*.plan.bin`` for the CUDA twin. The selector compares its estimate
(:mod:`.ws_cost`) with the block-/row-wise pick and takes it where it is lower
(``refines``); the tuner searches its configs beside theirs.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from stofc.kernels.attention.config import DTYPES, AttentionConfig, ExtraInputs, KernelSpec, prune
from stofc.kernels.attention.family import AttentionFamily, AttentionProblem
from stofc.kernels.attention.launch import LaunchData
from stofc.kernels.attention.render import FLAG
from stofc.kernels.attention.residue import PERIODS, choose_period, split_format
from stofc.kernels.attention.ws_cost import ws_config, ws_estimate, ws_split, ws_unspilled
from stofc.kernels.attention.ws_launch import WsLaunchPlan, config_plan, ws_launch_data
from stofc.kernels.attention.ws_plan import (
    ITEM_FIELDS,
    MAX_CHUNKS,
    MIN_SPLIT,
    WS_BLOCKS_PER_SM,
    consumers_of,
    lean_walk,
    lean_walk_applies,
)
from stofc.kernels.attention.ws_smem import (
    SMEM_RESERVED_PER_BLOCK,
    WORK_RECORD_BYTES,
    WS_ROWSUM_MMA,
    WS_TILE,
    ws_ones_bytes,
    ws_q_buffers,
    ws_q_in_regs,
    ws_rowsum_in_pv,
    ws_smem_bytes,
    ws_stage_o,
)
from stofc.kernels.registry import register
from stofc.masks.format import MaskFormat
from stofc.targets import GpuProfile

WS_CC = (9, 0)                 # setmaxnreg, wgmma and the TMA path: sm_90a only
WS_HEAD_DIMS = (64, 128, 256)  # whole 128-byte swizzle panels
WS_WARPS = (8, 12, 16, 20)     # producer + one, two, three or four consumer warpgroups
# ring depths: 5 ran level with 6 where both fit (four consumers at head_dim 64,
# ws-variants-stages-c4-h100-2026-11-27.jsonl), so the search space keeps one of them
WS_STAGES = (2, 3, 4, 6)
# consumers -> (producer, consumer) registers; the sum never exceeds the block's registers at
# entry (ptxas: 65536 / (threads x resident blocks), rounded down to 8: 168, 128, 96; 80 for
# one consumer's three blocks of 256), which setmaxnreg only moves (four: 24 x 128 +
# 4 x 112 x 128 <= 96 x 640; 120 each hung the block in setmaxnreg; one: 24 x 128 + 136 x 128
# = 80 x 256)
REG_SPLITS = {1: (24, 136), 2: (40, 232), 3: (32, 160), 4: (24, 112)}
# One consumer's three blocks an SM compile at head_dim 64 only: at 128, ptxas needs 94
# registers in the code before setmaxnreg where the block's entry share is 80 (C7602)
WS_ONE_CONSUMER_HEAD_DIM = 64
COMBINE_GROUPS = 16            # combine blocks per split pair row (kWsCombineGroups)
SPLITS = (0, 8, 16, 32, 64)    # search-space values of ``split`` (tiles per chunk)
KSTEPS = (1, 2)                # 64-key tiles per softmax step
# addresses, loop state, masks, softmax state: the four-warpgroup head_dim-64 kernel fits
# its 80 registers of arrays in 112 with no spill (ptxas 13.0), so at most 32
REG_OVERHEAD = 32


def ws_reg_split(consumers: int) -> tuple[int, int]:
    """(producer, consumer) registers per thread after ``setmaxnreg`` for a block of
    ``consumers`` consumer warpgroups (the register file: 128 x producer + 128 x consumers
    x consumer <= 64K). Two 64-key tiles per step fit two consumers' split once Q moves
    to shared memory (:func:`ws_q_in_regs`)."""
    return REG_SPLITS[consumers]


def ws_consumers(config: AttentionConfig) -> int:
    """Consumer warpgroups of a ws config (``warps`` 12: two, 16: three)."""
    return consumers_of(config.warps)


def ws_registers(head_dim: int, kstep: int = 1, consumers: int = 2) -> int:
    """Registers a consumer thread's live arrays need: O, S and the held P fragments of
    ``kstep`` 64-key tiles, Q (if held in registers)."""
    acc = head_dim // 2
    s, p = 32 * kstep, 16 * kstep
    q = head_dim // 4 if ws_q_in_regs(head_dim, kstep, consumers) else 0
    return acc + s + p + q + REG_OVERHEAD


def ws_prune(c: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
    """Why ``c`` (kind ``ws``) cannot run on ``profile``; None if it can."""
    if profile.compute_capability != WS_CC:
        return "the warp-specialised kernel is Hopper-only (sm_90a: setmaxnreg, wgmma, TMA)"
    if head_dim not in WS_HEAD_DIMS:
        return "ws: head_dim must be 64, 128 or 256 (whole 128-byte swizzle panels)"
    if c.tile != WS_TILE:
        return "ws: a consumer warpgroup owns one 64-row tile row (mask tile 64)"
    if c.warps not in WS_WARPS or (c.warp_m, c.q_split) != (16, 1):
        return ("ws: a producer and 1 to 4 consumer warpgroups (8, 12, 16 or 20 warps) of 64 "
                "rows each")
    consumers = ws_consumers(c)
    if c.min_blocks != WS_BLOCKS_PER_SM[consumers]:
        return (f"ws: blocks of {consumers} consumer warpgroup(s) run "
                f"{WS_BLOCKS_PER_SM[consumers]} to an SM (min_blocks), not {c.min_blocks}")
    if consumers == 1 and head_dim != WS_ONE_CONSUMER_HEAD_DIM:
        return ("ws: one consumer warpgroup (three blocks an SM) at head_dim 64 only: a block's "
                "80 registers at entry do not compile head_dim 128's code before setmaxnreg")
    if consumers == 1 and c.pingpong:
        return "ws: ping-pong turns need two or more consumer warpgroups"
    if c.gather or c.permute:
        return "ws: the TMA producer loads contiguous 64-key tiles (no gathered or permuted walk)"
    if c.stages not in WS_STAGES:
        return "ws: stages must be 2, 3, 4 or 6 (the ring of K/V tiles)"
    if c.kstep not in KSTEPS:
        return "ws: a softmax step covers 1 or 2 tiles of 64 keys"
    if c.stages < 2 * c.kstep:
        return "ws: the ring must hold two steps (stages >= 2 x tiles per step) to load ahead"
    if c.split < 0 or (c.split and c.split < MIN_SPLIT):
        return f"ws: split is 0 (never) or at least {MIN_SPLIT} tiles per chunk"
    if c.split_rows < 0 or (c.split_rows and not c.split):
        return "ws: split_rows is 0 (every row longer than split) or limits a split's rows"
    if c.mma != "wgmma":
        return "ws: the consumers use wgmma"
    if c.period != 1 and c.period not in PERIODS:
        return "ws: a residue split has period 2 or 4 (a TMA box of 64 residue rows spans <= 256)"
    smem = ws_smem_bytes(c.stages, head_dim, ws_consumers(c), c.kstep)
    if smem > profile.smem_per_block:
        return f"needs {smem} B of shared memory, the GPU allows {profile.smem_per_block} per block"
    if c.min_blocks * (smem + SMEM_RESERVED_PER_BLOCK) > profile.smem_per_sm:
        return (f"ws: {c.min_blocks} blocks of {smem} B (and {SMEM_RESERVED_PER_BLOCK} B the "
                f"system reserves each) do not fit the SM's {profile.smem_per_sm} B of shared memory")
    regs, cap = ws_registers(head_dim, c.kstep, ws_consumers(c)), ws_reg_split(ws_consumers(c))[1]
    if regs > cap:
        return (f"needs about {regs} registers per consumer thread (> {cap} with "
                f"{ws_consumers(c)} consumer warpgroups)")
    return None


@register
class AttentionWs(AttentionFamily):
    """The warp-specialised Hopper kernel (see the module doc)."""

    name = "attention_ws"
    kind = "ws"
    label = "warp-specialised"
    stof_class = "block"
    plan_code = 2
    # the plan's record (``attention/<kind>.cu.j2``, what plan.json has always stored for
    # attention), then the template file that renders it
    templates = ("attention/ws.cu.j2", "attention/block_ws.cu.j2")
    preference = 20
    space_order = 20
    tuner_tag = (("kind", "ws"),)
    refines = True           # compared with the block/row pick (:mod:`.select`)
    residue_split = True     # period > 1: a dilated mask's residues walked apart (.residue)
    launch_data_type = WsLaunchPlan

    def template_of(self, config: AttentionConfig) -> str:
        return self.templates[1]

    def target_for(self, config: AttentionConfig, target: str) -> str:
        if target in ("sm_90", "compute_90"):      # setmaxnreg, wgmma, TMA: sm_90a only
            return f"{target}a"
        return target

    def name_tag(self, config: AttentionConfig) -> str:
        return (f"{'_pp' if config.pingpong else ''}{'_k2' if config.kstep == 2 else ''}"
                f"{f'_p{config.period}' if config.period > 1 else ''}"
                f"{'_f' if config.lean_walk else ''}")

    def rows_per_block(self, config: AttentionConfig) -> int:
        return ws_consumers(config) * config.tile

    def describe(self, config: AttentionConfig) -> str:
        c = config
        return (f"warp-specialised T={c.tile} rows/block={self.rows_per_block(c)} "
                f"{f'blocks/SM={c.min_blocks} ' if c.min_blocks > 1 else ''}stages={c.stages}"
                f" keys/step={64 * c.kstep}{' pingpong' if c.pingpong else ''}"
                f"{f' split={c.split}' if c.split else ''}"
                f"{f' (the {c.split_rows} longest rows per head: a tail split)' if c.split_rows else ''}"
                f"{f' residues={c.period}' if c.period > 1 else ''}"
                f"{' lean walk (full tiles only)' if c.lean_walk else ''}")

    def smem_bytes(self, config: AttentionConfig, head_dim: int) -> int:
        return ws_smem_bytes(config.stages, head_dim, ws_consumers(config), config.kstep)

    def registers(self, config: AttentionConfig, head_dim: int) -> int:
        return ws_registers(head_dim, config.kstep, ws_consumers(config))

    def prune(self, config: AttentionConfig, head_dim: int, profile: GpuProfile) -> str | None:
        return ws_prune(config, head_dim, profile)

    def search_space(self, head_dim: int, profile: GpuProfile, *, tile: int, gatherable: bool,
                     permutable: bool) -> list[AttentionConfig]:
        out: list[AttentionConfig] = []
        if tile != WS_TILE:
            return out
        for warps, stages, pingpong, split, kstep in itertools.product(
                WS_WARPS, WS_STAGES, (True, False), SPLITS, KSTEPS):
            cfg = AttentionConfig("ws", WS_TILE, 16, warps, stages, 1,
                                  min_blocks=WS_BLOCKS_PER_SM[consumers_of(warps)], mma="wgmma",
                                  split=split, pingpong=pingpong, kstep=kstep)
            if prune(cfg, head_dim, profile) is None:
                out.append(cfg)
        return out

    def candidates(self, problem: AttentionProblem, profile: GpuProfile
                   ) -> tuple[list[AttentionConfig], dict[str, int]]:
        """The search space, each config also with the residue split where the mask has one
        (:func:`~.residue.choose_period`): the split walks fewer tiles, but its rows are
        shorter, so which wins (and with which split and ring) is measured. Those that spill
        with the node's inputs are left out, with the reason (:func:`~.ws_cost.ws_unspilled`)."""
        configs, extra = super().candidates(problem, profile)
        chosen = choose_period(problem.fmt)
        if chosen is not None:
            configs = configs + [replace(c, period=chosen[0]) for c in configs]
        configs, spills = ws_unspilled(configs, problem.head_dim, problem.extras)
        configs = configs + self._tail_splits(configs, problem, profile)
        return self._lean_walks(configs, problem), {**extra, **spills}

    @staticmethod
    def _lean_walks(configs: list[AttentionConfig],
                    problem: AttentionProblem) -> list[AttentionConfig]:
        """Each config with ``lean_walk`` where its plan on the problem's mask has one and the
        node takes it (:func:`.ws_plan.lean_walk_applies`; one plan per walk: consumer count,
        split and residue split)."""
        fmt = problem.fmt
        if not lean_walk_applies(problem.head_dim, problem.has_bias, problem.has_key_bits):
            return [replace(c, lean_walk=False) for c in configs]
        lean: dict[tuple[int, int, int, int], bool] = {}
        out = []
        for c in configs:
            key = (ws_consumers(c), c.split, c.split_rows, c.period)
            if key not in lean:
                lean[key] = lean_walk(config_plan(fmt, c))
            out.append(replace(c, lean_walk=lean[key]))
        return out

    @staticmethod
    def _tail_splits(configs: list[AttentionConfig], problem: AttentionProblem,
                     profile: GpuProfile) -> list[AttentionConfig]:
        """The unsplit configs again with the tail split the cost model gives their consumer
        count and residue split on this shape (:func:`~.ws_cost.ws_split`), where it gives
        one: which rows to cut depends on the shape, so the space's fixed splits miss it."""
        tails: dict[tuple[int, int], tuple[int, int]] = {}
        out = []
        for c in configs:
            if c.split:
                continue
            key = (ws_consumers(c), c.period)
            if key not in tails:
                walked = split_format(problem.fmt, c.period)
                tails[key] = ws_split(walked, profile, consumers=key[0],
                                      batch=problem.batch * c.period, heads=problem.heads,
                                      seq_len=-(-problem.seq_len // c.period),
                                      head_dim=problem.head_dim)
            split, rows = tails[key]
            if rows:
                out.append(replace(c, split=split, split_rows=rows))
        return out

    def entry_points(self, spec: KernelSpec) -> tuple[str, ...]:
        return (spec.name, f"{spec.name}_combine")

    def template_values(self, spec: KernelSpec) -> dict[str, Any]:
        """Every value ``block_ws.cu.j2`` substitutes."""
        c = spec.config
        producer, consumer = ws_reg_split(ws_consumers(c))
        return dict(kernel_name=spec.name, dtype=DTYPES[spec.dtype], head_dim=spec.head_dim,
                    stages=c.stages, pingpong=FLAG[c.pingpong], kstep=c.kstep,
                    consumers=ws_consumers(c), min_blocks=c.min_blocks,
                    producer_regs=producer, consumer_regs=consumer, max_chunks=MAX_CHUNKS,
                    combine_groups=COMBINE_GROUPS,
                    has_bias=FLAG[spec.has_bias], has_key_bits=FLAG[spec.has_key_bits],
                    has_softcap=FLAG[spec.has_softcap], period=c.period, item_fields=ITEM_FIELDS,
                    lean_walk=FLAG[c.lean_walk],
                    q_in_regs=FLAG[ws_q_in_regs(spec.head_dim, c.kstep, ws_consumers(c))],
                    stage_o=FLAG[ws_stage_o(c.stages, spec.head_dim, ws_consumers(c))],
                    rowsum_mma=FLAG[WS_ROWSUM_MMA], ones_bytes=ws_ones_bytes(spec.head_dim),
                    rowsum_in_pv=FLAG[ws_rowsum_in_pv(spec.head_dim)],
                    q_bufs=ws_q_buffers(c.stages, spec.head_dim, ws_consumers(c), c.kstep),
                    smem_bytes=ws_smem_bytes(c.stages, spec.head_dim, ws_consumers(c), c.kstep),
                    work_record_bytes=WORK_RECORD_BYTES,
                    trace_works=0)   # bench/ws_trace.py renders a traced copy (TRACE_WORKS)

    # -- the selector: its cost model (:mod:`.ws_cost`) ------------------------------------
    def starting_config(self, fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                        seq_len: int, head_dim: int, extras: ExtraInputs
                        ) -> AttentionConfig | None:
        return ws_config(fmt, profile, batch=batch, heads=heads, head_dim=head_dim,
                         seq_len=seq_len, extras=extras)

    def unavailable(self, fmt: MaskFormat, head_dim: int) -> str:
        return "warp-specialised needs a Hopper GPU, T=64 and head_dim 64, 128 or 256"

    def estimate_us(self, fmt: MaskFormat, profile: GpuProfile, config: AttentionConfig, *,
                    batch: int, heads: int, seq_len: int, head_dim: int) -> float:
        return ws_estimate(fmt, profile, config, batch=batch, heads=heads, seq_len=seq_len,
                           head_dim=head_dim)

    def advantage(self, fmt: MaskFormat) -> str:
        why = "TMA-fed warpgroup MMA on the contiguous 64x64 tiles of the walk"
        chosen = choose_period(fmt) if fmt.tile == WS_TILE else None
        if chosen is None:
            return why
        period, sub = chosen
        return (f"{why}; the mask splits into {period} residues (rows q % {period}) that "
                f"each walk {sub.load_col_idx.size} tiles of one shared sub-mask, "
                f"{period * sub.load_col_idx.size} in all against {fmt.load_col_idx.size} "
                f"checkerboard tiles unsplit (residues={period})")

    # -- launch: 384 or 512 threads, one block per work item (the plan's), the ws walk --
    def blocks_per_tile_row(self, config: AttentionConfig) -> int:
        """1: the attribute's fixed value for ws, whose grid is set by the plan's work
        items (``H * B * items_upto[P]``, at most WS_BLOCKS_PER_SM blocks an SM), not by tile rows."""
        return 1

    def shared_blocks_per_sm(self, config: AttentionConfig) -> int:
        """The persistent grid's blocks an SM (three with one consumer warpgroup)."""
        return WS_BLOCKS_PER_SM[ws_consumers(config)]

    def launch_data(self, fmt: MaskFormat, config: AttentionConfig) -> LaunchData:
        return ws_launch_data(fmt, config)

    def launch_key(self, config: AttentionConfig) -> str:
        """One plan file per split, block height and residue split: the config fields the
        walk uses."""
        rows = "" if ws_consumers(config) == 2 else f"-c{ws_consumers(config)}"
        return (f"ws{rows}{f'-split{config.split}' if config.split else ''}"
                f"{f'x{config.split_rows}' if config.split_rows else ''}"
                f"{f'-p{config.period}' if config.period > 1 else ''}")
