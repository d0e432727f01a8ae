"""The warp-specialised kernel's starting config and time estimate (for the selector).

Three calibrations, all from H100 runs of the kernel on the MASKS.md families:

* **head_dim 64** (``bench/results/ws-variants-d64-consumers-pingpong-h100-2026-11-27.jsonl``:
  H=12 fp16 at (1, 8192), (4, 4096), (2, 16384), (8, 512) and H=4 at (1, 8192); dense, causal,
  causal window 4095, windows +-64 / +-256, Longformer, BigBird; two, three and four
  consumer warpgroups with and without ping-pong turns in the same call, each fitted at the
  turns :func:`ws_pingpong` gives it; ``bench/ws_calibrate.py --variants FILE --head-dim 64
  --active --wave 0.69 --launch-us 9.72|10.37``): the model (``D64_COSTS``, per consumer
  count) charges each item ``entry_ns`` per entry of its merged walk, ``active_ns`` per
  warpgroup that computes the entry (without turns a step that fewer warpgroups compute is
  cheaper: BigBird's walks skip 46-57% of the pairs) and ``masked_ns`` per part tile (bitmap
  tests), per SM, ``wave_us`` per wave of items (start, Q load, epilogue) and
  ``launch_us`` per launch (less BLOCK_SHORT_BIAS_US), both held at the 11-26 fit's (0.69 us;
  9.72 / 10.37 us for two / three, and three's for four), which its runs of 128 to 512 tokens
  set (these long runs trade the two against each other: a free fit put the wave term
  negative), and a launch that splits rows COMBINE_US; the
  walk time is the busiest block's under the kernel's deal (:func:`~.ws_balance.dealt_loads`), not the
  mean, which put three consumers at B=1 H=4 L=8192 (172 works on 132 SMs) 1.4x short.
  Within 0.89-1.06x (two), 0.89-1.10x (three) and 0.88-1.07x (four) of those 35 runs each.
  The 11-26 model was 6.2% / 61.5% behind the same runs' fastest. Four were refitted once
  they read Q from two buffers (``ws-variants-d64-consumers-qbufs-h100-2026-11-27.jsonl``,
  ``--column c4``: 0.86-1.07x). Longformer is the family the form misses most (0.86-1.08x,
  both ways at H=4): its shared chunks' in-block merge has no term (since 11-28 a shared
  chunk costs its whole walk, :func:`_item_ns`). All three counts were refitted on the
  kernel with part tiles in fragment order and four consumers on six stages
  (``ws-variants-d64-consumers-fragbits-h100-2026-11-27.jsonl``, ``--column c2d|c3d|c4d``):
  within 0.92-1.06x (two), 0.92-1.11x (three), 0.87-1.06x (four); the picks over the 35 rows
  were 0.8% behind the fastest on average, 10.1% at worst (H=4 Longformer). One consumer
  (three blocks an SM, 2026-11-29): ``D64_COSTS[1]`` below.
* **head_dim 128** (``D128_COSTS``, per consumer count, the same form without the
  per-warpgroup term). Two consumers: ``bench/ws_calibrate.py --mha`` over the ws rows of
  ``bench/results/mha-hopper-h100-2026-11-26-{c3,prefetch}.json``, B=1 H=16 L=8K/16K bf16,
  every MASKS.md family: within 0.80-1.15x of those 36 runs, and 0.80-1.15x of the same
  ten shapes in ``ws-variants-d128-c3-h100-2026-11-26.jsonl``. Three (Q in shared memory):
  ``bench/ws_calibrate.py --variants`` over that file's ``c3q`` column (dense, causal,
  +-256, Longformer, BigBird at 8K/16K), the part-tile cost held at two consumers' (ten
  points do not separate it): 0.88-1.13x. Three are 4-11% faster on dense and causal rows
  and 5-12% slower on windows, Longformer and BigBird, and the two estimates order every
  one of those ten pairs as measured. The efficiency model it
  replaced (below, still head_dim 256's) was 0.72-1.30x off there: it charged part tiles
  1.45 full ones and the entries one warpgroup skips nothing, and so put the permuted
  block-wise kernel ahead at dilated L=8K (84 TFLOP/s measured against ws's 132).
* **head_dim 256** (two consumers; ``bench/results/mha-hopper-*-2026-11-25``, fitted at
  head_dim 128 then, not yet re-fitted): a full 64x64 tile step of one consumer warpgroup
  runs at ``WS_EFFICIENCY_D128`` of the fp16 tensor peak, part tiles cost
  MASKED_TILE_COST full ones, each block pays WS_BLOCK_US.

All are per-SM times on the calibration H100; another Hopper GPU scales them by its
per-SM tensor rate. One consumer (``D64_COSTS[1]``) is per block of three sharing an SM,
which :func:`~.ws_balance.sm_walk_ns` turns into the SM's time. The grid runs one block per SM (three
with one consumer); the longest item bounds the time
from below, which the row split (:func:`~stofc.kernels.attention.ws_plan.default_split`)
keeps short. Where no row is an outlier but the works leave a partial last wave (dense
rows at (1, 16, 8192) head_dim 128: 688 works on 132 SMs), :func:`ws_split` cuts a few
rows instead (:func:`~.ws_balance.tail_split`, ``AttentionConfig.split_rows``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from stofc.kernels.attention.config import NO_EXTRAS, AttentionConfig, ExtraInputs, prune
from stofc.kernels.attention.residue import choose_period, split_format
from stofc.kernels.attention.ws_balance import (
    COMBINE_US,
    dealt_loads,
    sm_walk_ns,
    tail_split,
    ws_grid_blocks,
)
from stofc.kernels.attention.ws_plan import (
    CONSUMERS,
    SKIP,
    WS_BLOCKS_PER_SM,
    WsPlan,
    consumers_of,
    default_split,
    lean_walk,
    lean_walk_applies,
    plan_ws,
)
from stofc.masks.format import MaskFormat
from stofc.targets import GpuProfile

WS_EFFICIENCY_D128 = 0.51
WS_BLOCK_US = 6.0
# A launch's fixed cost beyond the model's per-entry and per-wave terms (the first items'
# Q and K/V loads and the last epilogue, overlapped with nothing), net of the block-wise
# model's own bias at the same shapes: runs of one to three waves, (1, 128), (2, 512) and
# (8, 512) at H=12, measured 6.5-8 us above the fitted terms, where the block-wise
# estimate is 3-4 us short too (bench/results/ws-diag-short-h100-2026-11-26.jsonl). So
# the two compare as measured there: ws ahead at (2, 512), level at (1, 128).
LAUNCH_US = 4.0
# How far the block-wise model's estimate falls short of short runs (3-4 us at (1, 128) to
# (8, 512), ws-diag-short-h100-2026-11-26): a fitted ws launch constant is charged net of it,
# as LAUNCH_US is, so the two kernels compare as measured there.
BLOCK_SHORT_BIAS_US = 3.5
MASKED_TILE_COST = 1.45
CALIBRATION_SM_TFLOPS = 989.0 / 132     # H100 SXM: dense fp16 tensor peak per SM


@dataclass(frozen=True)
class EntryCost:
    """Per-SM nanoseconds of one walk entry (head_dim 64 and 128, fitted) and of a wave of items."""

    entry_ns: float
    active_ns: float
    masked_ns: float
    wave_us: float
    launch_us: float = LAUNCH_US      # a launch's fixed cost (module doc)


# fitted over ws-variants-d64-consumers-pingpong-h100-2026-11-27 (4-stage ring, O staged;
# columns c2pp / c3np / c4pp or c4np as ws_pingpong takes turns) with a per-active-warpgroup
# term, the wave term and the launch constants held at the 11-26 fit's (its short runs,
# 128-512 tokens, set them; four take three's), module doc. Four: refitted over
# ws-variants-d64-consumers-qbufs-h100-2026-11-27 (the same 35 runs once four read Q from two
# buffers, ws.ws_q_buffers; was 511 / 170 / 390); that call refits two and three within
# 4% / 11 ns of these (648 / 57 / 235, 500 / 162 / 237), so they stay.
# All three refitted once part tiles came in fragment order (ws_plan.fragment_bitmaps) and four
# got six stages: ws-variants-d64-consumers-fragbits-h100-2026-11-27 (the same 35 runs, each
# count at its ws_stages ring, columns c2dpp / c3dnp / c4dpp or c4dnp); the entry and
# per-warpgroup terms moved by <= 22 ns, the part-tile terms fell from 248 / 236 / 341 ns.
# 1: one consumer, three blocks an SM (per block while three share it), bench/ws_fit_one_consumer.py
#    over the 192 c1x3 runs of ws-variants-c1x3-h200-2026-11-29, put on the H100 scale by the
#    median measured / estimated of its two- to four-consumer runs (0.943): within 0.79-1.24x.
D64_COSTS = {1: EntryCost(1250.0, 0.0, 0.0, 1.5, 10.37 - BLOCK_SHORT_BIAS_US),
             2: EntryCost(619.0, 75.0, 136.0, 0.69, 9.72 - BLOCK_SHORT_BIAS_US),
             3: EntryCost(515.0, 155.0, 144.0, 0.69, 10.37 - BLOCK_SHORT_BIAS_US),
             4: EntryCost(466.0, 184.0, 211.0, 0.69, 10.37 - BLOCK_SHORT_BIAS_US)}
# 2: bench/ws_calibrate.py --mha over mha-hopper-h100-2026-11-26-{c3,prefetch} (2-stage ring)
# 3: bench/ws_calibrate.py --variants over ws-variants-d128-c3-h100-2026-11-26 (2-stage ring;
#    part tiles fixed at 71 ns)
D128_COSTS = {2: EntryCost(1059.0, 0.0, 71.0, 4.53), 3: EntryCost(1444.0, 0.0, 71.0, 7.67)}
# four consumers take ping-pong turns up to this share of skipped (entry, warpgroup) pairs
# (ws_pingpong); at 8K they skip 0 (dense), 1-5% (causal), 25% (bands), 35% (Longformer), 57%
# (BigBird)
PINGPONG_MAX_SKIPPED = 0.10
# One consumer: an entry's cost, relative to three blocks sharing the SM, once one (0.4) or two
# (0.67) still walk (fitted with D64_COSTS[1]: a block alone is not three times faster)
ONE_CONSUMER_PACE = (0.4, 0.67)
D64_STAGES = 4          # head_dim 64, two or three consumers: see ws_stages
D64_C1_STAGES = 3       # head_dim 64, one consumer (three blocks an SM): see ws_stages
D64_C4_STAGES = 6       # head_dim 64, four consumers: see ws_stages
D128_STAGES = 3         # head_dim 128, two consumers: see ws_stages
STAGES = 2              # head_dim 256 (three stages do not fit), and 128 with three consumers


def ws_stages(head_dim: int, consumers: int) -> int:
    """The ring depth a starting config gets (H100, bench/results/*-2026-11-26-*):

    * head_dim 64: four. Three ran 1-10% faster than two (ws-diag); four against three is
      level on dense and causal rows (+-0.5%) and 1-6% faster on windows, Longformer,
      BigBird and dilated bands (ws-variants-stages, ws-variants-consumers-stages-d64);
    * head_dim 64 with one consumer (three blocks an SM): three; two ran level
      (ws-variants-c1x3-h200-2026-11-29), four do not fit three blocks' shared memory;
    * head_dim 64 with four consumers: six (214.5 KB with two Q buffers). Their tile rows'
      walks are offset by up to three entries (a band's union walk), so four slots left the
      producer nothing to load ahead for the leading warpgroup: at (1, 12, 8192) six ran
      Longformer 3.5%, +-256 4%, +-64 5.5% and BigBird 1% faster than four, dense and causal
      level (ws-variants-stages-c4-h100-2026-11-27.jsonl, both orders; five level with six);
    * head_dim 128, two consumer warpgroups (the selector's pick there for windows and
      sparse masks): three, 1-10% faster than two on every such mask
      (mha-hopper-h100-2026-11-26-d128c3, +-64 windows the most; ws-variants-stages);
    * head_dim 128 with three consumers (dense, causal): two, within 2% of three either way
      (ws-variants-d128-c3); head_dim 256: two (three do not fit in shared memory).
    """
    if head_dim <= 64:
        return {1: D64_C1_STAGES, 4: D64_C4_STAGES}.get(consumers, D64_STAGES)
    if head_dim <= 128 and consumers == 2:
        return D128_STAGES
    return STAGES


def _entry_flags(plan: WsPlan, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per entry of the walk: live (key inside the run), active warpgroups, part tiles."""
    c = plan.consumers
    parts = np.asarray(plan.entry_part[:-c]).reshape(-1, c)
    live = np.asarray(plan.entry_key[:-1]) < seq_len
    active = ((parts != SKIP) & live[:, None]).sum(axis=1).astype(np.float64)
    masked = ((parts >= 0) & live[:, None]).sum(axis=1).astype(np.float64)
    return live.astype(np.float64), active, masked


def _entry_cum_ns(plan: WsPlan, seq_len: int, head_dim: int, sm_tflops: float) -> np.ndarray:
    """Cumulative per-SM nanoseconds of the walk's entries in a run of ``seq_len`` (``[n + 1]``,
    from 0): an item ``begin..end`` costs ``cum[end] - cum[begin]``."""
    live, active, masked = _entry_flags(plan, seq_len)
    if head_dim <= 128:
        k = (D64_COSTS if head_dim <= 64 else D128_COSTS)[plan.consumers]
        per_entry = (k.entry_ns * live + k.active_ns * active + k.masked_ns * masked)
        per_entry *= CALIBRATION_SM_TFLOPS / sm_tflops
    else:
        tile_flops = 4.0 * 64 * 64 * head_dim
        work = active + (MASKED_TILE_COST - 1.0) * masked
        per_entry = work * tile_flops / (WS_EFFICIENCY_D128 * sm_tflops * 1e12) * 1e9
    return np.concatenate([[0.0], np.cumsum(per_entry)])


def _item_ns(plan: WsPlan, head: int, seq_len: int, head_dim: int, sm_tflops: float) -> np.ndarray:
    """Per-SM nanoseconds of every item of ``head`` that a run of ``seq_len`` does.

    A shared chunk (a split row's chunk whose warpgroups take every C-th entry) costs its
    whole walk like any item: its warpgroups step through every entry together, each
    computing one in C with nothing to overlap it, so it walks no faster than one warpgroup
    computing every entry (NOTES.md, "The global rows are not paced by the producer": 1.1-1.3k
    cycles of the block an entry with two to four consumers, `noshare` the same). Charging it
    entries / C, as before, made three consumers look best for Longformer at (1, 12, 4096)
    where four ran 17-20% faster; over the 16 short H200 rows of
    ``ws-variants-consumers-short-h200-2026-11-28`` the pick's mean regret fell from 1.5% to
    0.1% (worst 20.4% -> 1.4%), over the 35 H100 rows of
    ``ws-variants-d64-consumers-fragbits-h100-2026-11-27`` from 2.1% to 1.8% (the 10% H=4
    Longformer row gone)."""
    cum = _entry_cum_ns(plan, seq_len, head_dim, sm_tflops)
    items = plan.items[head]
    ok = (items[:, 0] >= 0) & (items[:, 0] * plan.rows < seq_len)
    ns = cum[items[:, 2]] - cum[items[:, 1]]
    return np.where(ok, ns, 0.0)


def ws_estimate(fmt: MaskFormat, profile: GpuProfile, cfg: AttentionConfig, *, batch: int,
                heads: int, seq_len: int, head_dim: int) -> float:
    """Estimated microseconds of the ws kernel (and its combine) for one launch. A residue
    split (``cfg.period`` P > 1) is the split mask's walk for P times the batch over
    ``ceil(seq_len / P)`` rows: the same per-entry costs (its tiles are the mask's own)."""
    consumers = consumers_of(cfg.warps)
    if cfg.period > 1:
        fmt = split_format(fmt, cfg.period)
        batch, seq_len = batch * cfg.period, -(-seq_len // cfg.period)
    plan = plan_ws(fmt, split_tiles=cfg.split, consumers=consumers, split_rows=cfg.split_rows)
    per_fmt_head = heads if fmt.num_heads == 1 else 1
    sm_tflops = profile.fp16_tflops / profile.sm_count
    costs = [_item_ns(plan, h, seq_len, head_dim, sm_tflops) for h in range(plan.num_heads)]
    blocks = sum(int((c > 0).sum()) for c in costs) * per_fmt_head * batch
    grid = ws_grid_blocks(profile, consumers)
    waves = math.ceil(blocks / grid) if blocks else 0
    if head_dim <= 64:          # the busiest block's time, the form D64_COSTS was fitted in
        loads = dealt_loads(plan, costs, seq_len, heads=heads, batch=batch, sm_count=grid)
        walk = sm_walk_ns(loads, WS_BLOCKS_PER_SM[consumers], profile.sm_count,
                          ONE_CONSUMER_PACE)
    else:                       # the mean (or the longest item), head_dim 128's fitted form
        total = sum(float(c.sum()) for c in costs) * per_fmt_head * batch
        longest = max(float(c.max()) if c.size else 0.0 for c in costs)
        walk = max(total / profile.sm_count, longest)
    costs_k = (D64_COSTS if head_dim <= 64 else D128_COSTS if head_dim <= 128 else None)
    wave_us = costs_k[consumers].wave_us if costs_k else WS_BLOCK_US
    launch_us = costs_k[consumers].launch_us if costs_k else LAUNCH_US
    combine = COMBINE_US if plan.splits else 0.0
    return walk * 1e-3 + waves * wave_us + launch_us + combine


def _item_overhead_ns(plan: WsPlan, head_dim: int) -> float:
    """What a block pays per item besides its walk (start, Q load, epilogue): the model's wave
    term, which every block pays once per item it takes."""
    table = D64_COSTS if head_dim <= 64 else D128_COSTS if head_dim <= 128 else None
    return (table[plan.consumers].wave_us if table else WS_BLOCK_US) * 1e3


def ws_split(fmt: MaskFormat, profile: GpuProfile, *, consumers: int, batch: int, heads: int,
             seq_len: int, head_dim: int) -> tuple[int, int]:
    """``(split, split_rows)`` of a ws launch walking ``fmt`` (a residue split's mask, with
    ``batch`` counting its residues): :func:`~.ws_plan.default_split` where some row is an
    outlier, else :func:`~.ws_balance.tail_split` (0, 0 where neither pays)."""
    plan = plan_ws(fmt, consumers=consumers)           # the unsplit walk, planned once
    grid = ws_grid_blocks(profile, consumers)
    split = default_split(fmt, batch=batch, heads=heads, sm_count=grid,
                          consumers=consumers, plan=plan)
    if split:
        return split, 0
    cum = _entry_cum_ns(plan, seq_len, head_dim, profile.fp16_tflops / profile.sm_count)
    return tail_split(plan, cum, _item_overhead_ns(plan, head_dim), profile, batch=batch,
                      heads=heads, seq_len=seq_len, head_dim=head_dim, grid_blocks=grid)


def skipped_share(plan: WsPlan) -> float:
    """The share of the walk's (entry, warpgroup) pairs that the warpgroup skips (its tile
    row does not hold the tile): 0 for dense rows, a few percent for causal ones, a fifth to
    a quarter for bands, Longformer and BigBird."""
    c = plan.consumers
    parts = np.asarray(plan.entry_part[:-c]).reshape(-1, c)
    return float((parts == SKIP).mean()) if parts.size else 0.0


def ws_pingpong(plan: WsPlan) -> bool:
    """Whether the consumers take ping-pong turns (``AttentionConfig.pingpong``) on ``plan``.

    Turns go round robin over the walk's steps, also those a warpgroup skips, so on a walk
    with many skipped pairs (:func:`skipped_share`) each warpgroup waits out the others'
    steps. Measured on an H100, same calls (``bench/results/ws-variants-d64-consumers-
    pingpong-h100-2026-11-27.jsonl``, ``ws-variants-d128-consumers-pingpong-h100-2026-11-27.jsonl``,
    ``ws-variants-c4-h100-2026-11-27.jsonl``):

    * four consumers (head_dim 64 only, :func:`~.ws.ws_prune`): turns run dense and causal
      rows 8-25% faster, and
      Longformer, BigBird and +-256 windows 3-8% slower: taken where at most
      PINGPONG_MAX_SKIPPED of the pairs are skipped;
    * three: turns never paid (head_dim 64: level to 4% slower; 128: level to 6% slower on
      every mask, +-64 / +-256 windows and Longformer 2-6%): never taken (turns that skip the
      skipped steps were slower still, ``ws-variants-own-turns-tried-h100-2026-11-27.jsonl``);
    * two: -2.4% to +2.4% at head_dim 64 and level on head_dim 128's sparse masks (1-5% in
      favour of turns on 11-26's kernel, ``ws-variants-pingpong-h100-2026-11-26.jsonl``):
      always taken, as before;
    * one: no other warpgroup to take turns with."""
    if plan.consumers in (1, 3):
        return False
    if plan.consumers == 2:
        return True
    return skipped_share(plan) <= PINGPONG_MAX_SKIPPED


def ws_spills(config: AttentionConfig, head_dim: int, extras: ExtraInputs) -> str | None:
    """Why ``config`` (kind ``ws``) is left out for a node that also reads ``extras``: it
    spills registers and runs slower than the same kernel with one consumer fewer; None
    where it does not (as measured). The selector (:func:`ws_config`) and the tuner
    (:meth:`~.ws.AttentionWs.candidates`) skip what it refuses.

    Four consumer warpgroups (``setmaxnreg`` 112 registers each; head_dim 64 only, one
    64-key tile per step: :func:`~.ws.ws_prune`) spill with an additive bias. ptxas (nvcc
    13.0, sm_90a) at head_dim 64: 108 bytes of spill stores with the bias alone, 84 with the
    bias, key bits and soft-capping. Timed on an H100 with a bias
    (``bench/results/ws-variants-bias-h100-2026-11-28.jsonl``, fp16, B=2 H=12 at 4K and 16K,
    dense and causal), four ran 17-22% slower than three. With soft-capping alone they spill
    8 bytes and still ran 2-12% faster than three (``ws-variants-softcap-h100-2026-11-28``),
    and with key-padding bits alone they do not spill: both keep four. One consumer
    (136 registers, three blocks an SM) spills 20 bytes with a bias (ptxas 13.0, head_dim 64,
    both dtypes, rings of two and three; none with key bits or soft-capping alone), untimed,
    so it is refused with a bias too. Two and three consumers spill with none of these (``NOTES.md``, "Known spills";
    ``tests/unit/test_attention_ws.py``, ``KNOWN_SPILLS``)."""
    consumers = consumers_of(config.warps)
    if consumers in (2, 3) or not extras.has_bias:
        return None
    if consumers == 1:
        return (f"ws: one consumer warpgroup (136 registers, three blocks an SM) spills with a "
                f"bias at head_dim {head_dim} (ptxas: 20 bytes of spill stores; not timed)")
    return (f"ws: four consumer warpgroups (112 registers each) spill with a bias at "
            f"head_dim {head_dim} (ptxas: 84-108 bytes of spill stores) and ran 17-22% "
            f"slower than three; two and three do not spill")


def ws_unspilled(configs: list[AttentionConfig], head_dim: int, extras: ExtraInputs
                 ) -> tuple[list[AttentionConfig], dict[str, int]]:
    """``configs`` less those :func:`ws_spills` refuses with ``extras`` (order kept), and
    how many it refused for each reason (the tuner's pruning report)."""
    spills = [ws_spills(c, head_dim, extras) for c in configs]
    kept = [c for c, why in zip(configs, spills, strict=True) if why is None]
    return kept, dict(Counter(why for why in spills if why is not None))


def ws_config(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
              head_dim: int, seq_len: int | None = None, extras: ExtraInputs = NO_EXTRAS
              ) -> AttentionConfig | None:
    """The starting ws config: one tile per step, the ring depth measured fastest for the
    head_dim and consumer count (:func:`ws_stages`), ping-pong turns where
    :func:`ws_pingpong` takes them, and of the consumer counts that
    :func:`~stofc.kernels.attention.config.prune` allows (three up to head_dim 128, four and
    one at 64) and that :func:`ws_spills` keeps for the node's ``extras`` (not four with a bias),
    with and
    without the mask's residue split (:func:`~.residue.choose_period`, where it has one),
    the one estimated faster on this mask at ``seq_len`` (default L_max), each with its rows
    split for this batch and head count, and ``lean_walk`` where its plan has one and the
    node takes it (:func:`~.ws_plan.lean_walk_applies`: head_dim, no bias, no key bits);
    None where no ws config runs (not Hopper, tile or head_dim)."""
    if fmt.tile != 64:
        return None
    best: tuple[float, AttentionConfig, MaskFormat] | None = None
    chosen = choose_period(fmt)
    periods = [(1, fmt)] + ([chosen] if chosen is not None else [])
    for (period, walked), consumers in itertools.product(periods, CONSUMERS):
        probe = AttentionConfig("ws", 64, 16, 4 * (consumers + 1),
                                ws_stages(head_dim, consumers), 1,
                                min_blocks=WS_BLOCKS_PER_SM[consumers], mma="wgmma",
                                pingpong=consumers > 1, period=period)
        if (prune(probe, head_dim, profile) is not None     # before the split's plan_ws
                or ws_spills(probe, head_dim, extras) is not None):
            continue
        split, split_rows = ws_split(walked, profile, consumers=consumers,
                                     batch=batch * period, heads=heads,
                                     seq_len=-(-(seq_len or fmt.seq_len) // period),
                                     head_dim=head_dim)
        cfg = replace(probe, split=split, split_rows=split_rows)
        us = ws_estimate(fmt, profile, cfg, batch=batch, heads=heads,
                         seq_len=seq_len or fmt.seq_len, head_dim=head_dim)
        if best is None or us < best[0]:
            best = (us, cfg, walked)
    if best is None:
        return None
    _, cfg, walked = best
    plan = plan_ws(walked, split_tiles=cfg.split, consumers=consumers_of(cfg.warps),
                   split_rows=cfg.split_rows)
    lean = lean_walk_applies(head_dim, extras.has_bias, extras.has_key_bits) and lean_walk(plan)
    return replace(cfg, pingpong=ws_pingpong(plan), lean_walk=lean)
