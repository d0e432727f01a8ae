"""How a ws launch's works fall on the SMs, and the tail split that evens them out.

The persistent ws kernel deals its works statically (``ws_work_index``, ws.cuh): works
longest first, in snaking waves over the blocks. :func:`dealt_loads` gives each block's
total of a per-item quantity under that deal (the cost model's busiest block,
:mod:`.ws_cost`); :func:`tail_split` picks the few pair rows whose cutting fills a partial
last wave (``AttentionConfig.split_rows``, :func:`~.ws_plan.split_pairs`), and
:func:`combine_us` what the chunks' combine costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stofc.kernels.attention.ws_plan import (
    MAX_CHUNKS,
    MIN_SPLIT,
    WS_BLOCKS_PER_SM,
    WsPlan,
    split_pairs,
)
from stofc.targets import GpuProfile

# The combine kernel of a launch that splits rows: CUPTI put it at 5.4 / 6.1 us per launch in
# BERT-base's (1, 8192) Longformer / BigBird packages (e2e-long-h100-2026-11-26-combine), and
# one stream launch after the main kernel adds about a microsecond.
COMBINE_US = 6.0
# tail_split: chunk counts tried, the most pair rows per head it cuts and the estimated gain
# it must promise. The gain measured is about half the estimate (a last wave of few blocks
# runs faster than the model's per-SM rate: the H100 averaged 1936 MHz at 150-400 W and
# 1738 MHz above 600 W, mha-hopper-h100-2026-11-28-paired-clocks.csv): head_dim 128 dense at
# (1, 16, 8192), 12% estimated, ran 5.5-7% faster; at (1, 16, 16384), 4.4% estimated, level
# to 3% (ws-variants-tail-h100-2026-11-28.jsonl). So it must promise 5%.
TAIL_CHUNKS = (2, 3, 4, 6, 8)
TAIL_MAX_ROWS = 64
TAIL_MIN_GAIN = 0.05


def dealt_loads(plan: WsPlan, per_item: list[np.ndarray], seq_len: int, *, heads: int,
                batch: int, sm_count: int) -> np.ndarray:
    """Each block's total of a per-item quantity under the kernel's deal of a run of
    ``seq_len``: work ``w`` is head ``w % H``, then batch, then the item in launch order
    (longest first), dealt in snaking waves of ``min(works, SMs)`` blocks
    (``ws_work_index``, ws.cuh). ``per_item[h]``: head ``h``'s value of each of its items
    (one array for a walk every head shares). A launch lasts as long as its busiest
    block: the mean where works are many and alike, up to 1.5x the mean where a partial
    last wave gives some blocks one work more (B=1 H=4 L=8192: 172 works of three tile rows
    on 132 SMs), and the longest work where works are fewer than SMs."""
    off, n = plan.launch_items(seq_len)
    ordered = [v[plan.orders[h, off:off + n]] for h, v in enumerate(per_item)]
    return deal(ordered, heads=heads, batch=batch, sm_count=sm_count)


def ws_grid_blocks(profile: GpuProfile, consumers: int) -> int:
    """The persistent grid's blocks when works are plenty: WS_BLOCKS_PER_SM on every SM."""
    return profile.sm_count * WS_BLOCKS_PER_SM[consumers]


def sm_walk_ns(loads: np.ndarray, blocks_per_sm: int, sm_count: int,
               pace: tuple[float, ...] = ()) -> float:
    """The busiest SM's walk, from each block's dealt load (ns at the pace of every resident
    block walking). One block an SM: the busiest block. Several (block ``k * sm_count + s`` on
    SM ``s``): while all of an SM's blocks walk, at that pace; once fewer do, at ``pace[i]``
    of it per entry while ``i + 1`` still walk (the last block alone first)."""
    loads = np.asarray(loads, np.float64)
    if blocks_per_sm == 1 or loads.size <= 1:
        return float(loads.max()) if loads.size else 0.0
    if len(pace) != blocks_per_sm - 1:
        raise ValueError(f"{blocks_per_sm} blocks an SM need {blocks_per_sm - 1} paces")
    per_sm = np.zeros(blocks_per_sm * sm_count)
    per_sm[:loads.size] = loads
    grid = -np.sort(-per_sm.reshape(blocks_per_sm, sm_count), axis=0)   # l1 >= l2 >= ...
    steps = np.vstack([grid[:-1] - grid[1:], grid[-1:]])
    return float((np.asarray((*pace, 1.0))[:, None] * steps).sum(axis=0).max())


def deal(ordered: list[np.ndarray], *, heads: int, batch: int, sm_count: int) -> np.ndarray:
    """Each block's total under ``ws_work_index``'s snaking deal of the works whose
    per-head values, in launch order, are ``ordered`` (one array: every head's walk)."""
    if len(ordered) == 1:               # one walk for every head and batch
        work = np.repeat(ordered[0], heads * batch)
    else:                               # per-head walks: [item, batch, head]
        work = np.repeat(np.stack(ordered, axis=1)[:, None, :], batch, axis=1).reshape(-1)
    if work.size == 0:
        return np.zeros(1)
    grid = min(sm_count, work.size)
    waves = -(-work.size // grid)
    flat = np.zeros(waves * grid)
    flat[:work.size] = work
    dealt = flat.reshape(waves, grid)
    dealt[1::2] = dealt[1::2, ::-1]     # odd waves run backwards over the blocks
    return np.asarray(dealt.sum(axis=0))


def chunk_costs(cum: np.ndarray, starts: np.ndarray, lengths: np.ndarray, split: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every pair row of one head cut as :func:`~.ws_plan.plan_ws` cuts a row longer than
    ``split`` entries (``_chunks``: near-equal, edges rounded alike, at most MAX_CHUNKS):
    each chunk's row, its index in the row, its entries and its cost ``cum[end] -
    cum[begin]`` (``cum``: the entries' cumulative cost; ``starts`` / ``lengths``: each
    row's first entry and count)."""
    k = np.where(lengths > split, np.minimum(-(-lengths // split), MAX_CHUNKS), 1)
    row = np.repeat(np.arange(lengths.size), k)
    i = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    n, kk = lengths[row], k[row]
    a = np.round(i * n / kk).astype(np.int64)
    b = np.round((i + 1) * n / kk).astype(np.int64)
    return row, i, b - a, cum[starts[row] + b] - cum[starts[row] + a]


def launch_order(rows: np.ndarray, index: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """The order the kernel launches items in, given each item's pair row, index in its row
    (0 for a whole row) and entries: ``plan_ws``'s, most entries of the full walk first
    (not the run's), ties in plan order (row, then chunk)."""
    pos = np.lexsort((index, rows))
    return pos[np.argsort(-entries[pos], kind="stable")]


def tail_split(plan: WsPlan, cum: np.ndarray, item_ns: float, profile: GpuProfile, *,
               batch: int, heads: int, seq_len: int, head_dim: int,
               grid_blocks: int = 0) -> tuple[int, int]:
    """``(split, split_rows)`` that fill a launch's last wave, or ``(0, 0)``.

    ``plan`` is the unsplit walk, ``cum`` its entries' cumulative per-SM ns in the run of
    ``seq_len`` (keys past it cost nothing), ``item_ns`` what a block pays per item besides
    its walk (the cost model's, :mod:`.ws_cost`). Where the works are alike (dense, or any
    mask whose longest-first deal leaves a partial last wave), the busiest block takes one
    work more than the mean: at (1, 16, 8192) head_dim 128 with three consumers, 688 works
    of 128 entries on 132 SMs give 28 blocks six works where the mean is 5.2, 15% above it.
    Cutting a few of the longest pair rows into chunks (:func:`~.ws_plan.split_pairs`: the
    rows ``plan_ws`` cuts, by their full length, not the run's) puts small works at the end
    of the longest-first order, which the deal spreads over the blocks that took one work
    fewer. Candidates: chunks of ``ceil(longest / c)`` entries for ``c`` in TAIL_CHUNKS (at
    least ``ws_plan.MIN_SPLIT`` entries, as ``ws_prune`` asks), the 1 to TAIL_MAX_ROWS
    longest rows per head;
    each is estimated as the busiest block under the kernel's deal (:func:`deal`; per item
    its entries in the run plus ``item_ns``, a chunk whose keys all lie past the run too)
    plus the combine (:func:`combine_us`). A chunk one warpgroup computes alone becomes a
    shared chunk, whose walk costs as much as anyone's (:func:`~.ws_cost._item_ns`). Taken
    only where it is estimated TAIL_MIN_GAIN faster than no split (the combine, the fp32
    partials and the estimate's error are what it must beat); launches whose busiest block
    is within that of the mean are not searched. ``grid_blocks``: the persistent grid's
    blocks (0: one per SM; ``cum`` and ``item_ns`` are then per block)."""
    blocks = grid_blocks or profile.sm_count
    per_fmt_head = heads if plan.num_heads == 1 else 1
    rows_of = np.arange(plan.pairs)
    launched = rows_of * plan.rows < seq_len
    ptr = np.asarray(plan.pair_ptr, np.int64)
    starts = [ptr[h, :-1] for h in range(plan.num_heads)]
    lengths = [ptr[h, 1:] - ptr[h, :-1] for h in range(plan.num_heads)]
    whole = [cum[ptr[h, 1:]] - cum[ptr[h, :-1]] for h in range(plan.num_heads)]

    def busiest(split: int, rows: int,
                cuts: Sequence[tuple[np.ndarray, ...]] | None) -> tuple[float, int]:
        """(busiest block ns, launched chunks over the launch) with ``rows`` rows cut."""
        ordered, chunks = [], 0
        for h in range(plan.num_heads):
            cut = (split_pairs(lengths[h], split, rows) if split and cuts is not None
                   else np.zeros(plan.pairs, bool)) & launched
            kept = np.nonzero(launched & ~cut)[0]            # whole rows, one item each
            parts = [(kept, np.zeros(kept.size, np.int64), lengths[h][kept], whole[h][kept])]
            if cut.any():
                assert cuts is not None                      # a cut needs the chunks
                crow, cidx, cent, ccost = cuts[h]
                sel = cut[crow]
                parts.append((crow[sel], cidx[sel], cent[sel], ccost[sel]))
                chunks += int(sel.sum())
            row, idx, ent, cost = (np.concatenate(x) for x in zip(*parts, strict=True))
            ordered.append(cost[launch_order(row, idx, ent)] + item_ns)
        total = deal(ordered, heads=heads, batch=batch, sm_count=blocks)
        return float(total.max()), chunks * per_fmt_head * batch

    base, _ = busiest(0, 0, None)
    works = int(launched.sum()) * plan.num_heads * per_fmt_head * batch
    walk = sum(float(w[launched].sum()) for w in whole) * per_fmt_head * batch
    mean = (walk + item_ns * works) / blocks
    if works == 0 or base <= mean * (1.0 + TAIL_MIN_GAIN):
        return 0, 0
    longest = max(int(n[launched].max()) for n in lengths)
    best = (base * 1e-3 * (1.0 - TAIL_MIN_GAIN), 0, 0)
    for c in TAIL_CHUNKS:
        split = -(-longest // c)
        if split < MIN_SPLIT:
            continue
        cuts = [chunk_costs(cum, starts[h], lengths[h], split) for h in range(plan.num_heads)]
        cuttable = max(int(((n > split) & launched).sum()) for n in lengths)
        for rows in range(1, min(cuttable, TAIL_MAX_ROWS) + 1):
            ns, chunks = busiest(split, rows, cuts)
            us = ns * 1e-3 + combine_us(chunks, plan.rows, head_dim, profile)
            if us < best[0]:
                best = (us, split, rows)
    return best[1], best[2]


def combine_us(chunks: int, rows: int, head_dim: int, profile: GpuProfile) -> float:
    """A launch's combine for ``chunks`` chunks of ``rows`` query rows: COMBINE_US, and each
    chunk's fp32 partial O, row max and row sum written by the main kernel and read back."""
    if chunks == 0:
        return 0.0
    traffic = 2.0 * chunks * rows * (head_dim + 2) * 4
    return COMBINE_US + traffic / (profile.mem_bandwidth_gbs * 1e3)
