"""How a ws launch's works fall on the SMs, and the tail split that evens them out.

The persistent ws kernel deals its works statically (``ws_work_index``, ws.cuh): works
longest first, in snaking waves over the blocks. :func:`dealt_loads` gives each block's
total of a per-item quantity under that deal (the cost model's busiest block,
:mod:`.ws_cost`); :func:`tail_split` picks the few pair rows whose cutting fills a partial
last wave (``AttentionConfig.split_rows``, :func:`~.ws_plan.split_pairs`), and
:func:`combine_us` what the chunks' combine costs.
"""

from __future__ import annotations

import numpy as np

from stofc.kernels.attention.ws_plan import WsPlan, split_pairs
from stofc.targets import GpuProfile

# The combine kernel of a launch that splits rows: CUPTI put it at 5.4 / 6.1 us per launch in
# BERT-base's (1, 8192) Longformer / BigBird packages (e2e-long-h100-2026-11-26-combine), and
# one stream launch after the main kernel adds about a microsecond.
COMBINE_US = 6.0
# tail_split: chunk counts tried, the most pair rows per head it cuts, the smallest chunk
# (ws_prune's least split) and the estimated gain it must promise. The gain measured is about
# half the estimate (a last wave of few blocks runs faster than the model's per-SM rate: the
# H100 averaged 1936 MHz at 150-400 W and 1738 MHz above 600 W,
# mha-hopper-h100-2026-11-28-paired-clocks.csv): head_dim 128 dense at (1, 16, 8192), 12% estimated,
# ran 5.5-7% faster; at (1, 16, 16384), 4.4% estimated, level to 3%
# (ws-variants-tail-h100-2026-11-28.jsonl). So it must promise 5%.
TAIL_CHUNKS = (2, 3, 4, 6, 8)
TAIL_MAX_ROWS = 64
MIN_SPLIT = 8
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


def tail_split(plan: WsPlan, costs: list[np.ndarray], item_ns: float, profile: GpuProfile, *,
               batch: int, heads: int, head_dim: int) -> tuple[int, int]:
    """``(split, split_rows)`` that fill a launch's last wave, or ``(0, 0)``.

    ``plan`` is the unsplit walk, ``costs`` per format head the per-SM ns of each of its items
    in the run (0: not launched), ``item_ns`` what a block pays per item besides its walk
    (the cost model's, :mod:`.ws_cost`). Where its works are alike (dense, or any mask whose
    longest-first deal leaves a partial last wave), the busiest block takes one work more
    than the mean: at (1, 16, 8192) head_dim 128 with three consumers, 688 works of 128
    entries on 132 SMs give 28 blocks six works where the mean is 5.2, 15% above it.
    Cutting a few of the longest pair rows into chunks (:func:`~.ws_plan.split_pairs`) puts
    small works at the end of the longest-first order, which the deal spreads over the
    blocks that took one work fewer. Candidates: chunks of ``ceil(longest / c)`` entries for
    ``c`` in TAIL_CHUNKS (at least 8 entries, ``ws_prune``), the first 1 to TAIL_MAX_ROWS
    longest rows per head; each is estimated as the busiest block under the kernel's deal
    (:func:`deal`; per item its walk plus the wave term) plus the combine
    (:func:`combine_us`). Taken only where it is estimated TAIL_MIN_GAIN faster than no split (the
    combine, the partial O's fp32 traffic and the estimate's error are what it must beat);
    launches whose busiest block is within that of the mean are not searched."""
    live = [c > 0 for c in costs]
    lengths = [np.where(ok, t, 0) for ok, t in zip(live, plan.tiles_per_pair, strict=True)]
    per_fmt_head = heads if plan.num_heads == 1 else 1

    def busiest(split: int, rows: int) -> tuple[float, int]:
        """(busiest block ns, live chunks over the launch) with rows cut at ``split``."""
        ordered, chunks = [], 0
        for cost, ok, n in zip(costs, live, lengths, strict=True):
            cut = split_pairs(n, split, rows) & ok if split else np.zeros(n.size, bool)
            k = np.where(cut, -(-n // max(split, 1)), 1)
            per = np.repeat(cost / k, k)[np.repeat(ok, k)] + item_ns
            chunks += int(k[cut].sum())
            ordered.append(np.sort(per)[::-1])
        total = deal(ordered, heads=heads, batch=batch, sm_count=profile.sm_count)
        return float(total.max()), chunks * per_fmt_head * batch

    base, _ = busiest(0, 0)
    works = sum(int(ok.sum()) for ok in live) * per_fmt_head * batch
    mean = sum(float(c.sum()) for c in costs) * per_fmt_head * batch / profile.sm_count
    mean += item_ns * works / profile.sm_count
    if works == 0 or base <= mean * (1.0 + TAIL_MIN_GAIN):
        return 0, 0
    longest = max(int(n.max()) for n in lengths)
    best = (base * 1e-3 * (1.0 - TAIL_MIN_GAIN), 0, 0)
    for c in TAIL_CHUNKS:
        split = -(-longest // c)
        if split < MIN_SPLIT:
            continue
        cuttable = max(int((n > split).sum()) for n in lengths)
        for rows in range(1, min(cuttable, TAIL_MAX_ROWS) + 1):
            ns, chunks = busiest(split, rows)
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
