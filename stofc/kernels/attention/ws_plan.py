"""The warp-specialised kernel's walk: block rows of tile rows, work items and their split.

The warp-specialised (``ws``) kernel gives a thread block ``64 * C`` query rows: the
``C`` consumer warpgroups (``consumers``, 1 to 4) each own one 64-row mask tile row,
``C p .. C p + C - 1`` for the block's *pair row* ``p`` (the name of the two-consumer
case, kept for every ``C``). The warpgroups read the K/V tiles one producer warp
streams through a shared-memory ring, so they walk ONE list: the union of their tile
rows' columns in ascending key order. Each entry says, per warpgroup, whether that
warpgroup computes the tile and how (:data:`SKIP`, :data:`FULL` or the row of the
part tile's 8x8 bitmaps). A band of width 64 costs each of two warpgroups its own 3
tiles while the block loads 4.

A pair row whose list is much longer than the others (global tokens, BigBird's
global blocks, causal rows at small batch) would be the critical path of the
whole launch. :func:`plan_ws` cuts every list longer than ``split_tiles`` into
near-equal chunks; each chunk is a *work item* whose block writes its unnormalised
partial output, row max and row sum to a workspace slot, and a combine kernel
merges the chunks of a row by their log-sum-exp. Items run longest first, so the
critical path follows the total work divided by the SMs, not the longest row.

*Shared chunks.* Past its band, a global tile row (Longformer's first 16 queries) walks
every key tile alone: in such a chunk one warpgroup computes and the others skip, and a
warpgroup's step is bound by its own latency (S, softmax, P V), so the block ran at a
third of its rate for a fifth of a Longformer launch. A chunk whose entries only one
warpgroup ``w0`` computes is instead *shared*: every warpgroup loads that tile row's Q and
takes every C-th entry (the warpgroups do not take turns there), the others leave their
partials in the chunk's own slot, in the rows of the pair row's other tile rows (which
the chunk does not compute), and warpgroup 0 merges them in the block, writes tile row
``w0``'s rows and marks the others empty, so the chunk is one of the combine's and needs
no slot more than an ordinary chunk (the earlier C - 1 scratch slots per shared chunk
made a Longformer launch at 32K rows with four consumers take 61 slots, not 16).

*One consumer, three blocks an SM.* With ``C = 1`` a block walks one tile row's own list
(no union, no step a warpgroup skips), and three such blocks share an SM
(:data:`WS_BLOCKS_PER_SM`): the hardware interleaves three independent walks, each with
its own ring, where a block of four consumers steps them through one union list. Scattered
masks lose less to skipped steps that way (BigBird's union walks skip 46-57% of the pairs
with four consumers); dense and causal rows lose the K/V reuse of a wide block.

Only contiguous 64-key tiles are walked (the producer loads them with the Tensor
Memory Accelerator); gathered walks stay with the block-wise kernels. A dilated mask is
walked by residue instead (:mod:`.residue`): the plan is this walk of the split mask, and
the kernel runs it once per residue through tensor maps that step ``P`` rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from stofc.masks.format import MaskFormat

WS_TILE = 64          # mask tile of the ws kernel: a warpgroup's 64 query rows, 64-key steps
CONSUMERS = (1, 2, 3, 4)    # consumer warpgroups per block (64 query rows each)
# consumer warpgroups -> blocks resident on one SM (the kernel's __launch_bounds__ minimum
# and the persistent grid's blocks per SM; the ORT twin's ws_blocks_per_sm): one consumer
# runs three blocks an SM (module doc), wider blocks one
WS_BLOCKS_PER_SM = {1: 3, 2: 1, 3: 1, 4: 1}
SKIP, FULL = -2, -1   # entry_part values besides part-tile rows
ITEM_FIELDS = 5       # (pair row, begin, end, slot, shared); slot -1 writes the output directly
MIN_SPLIT = 8         # the fewest entries a chunk of a split row has (its combine traffic)
# ... that default_split cuts for one consumer warpgroup: its chunks are works of their own
# (a Q load, an epilogue and a combine slot each, no ring shared with a neighbour), and
# BigBird at (1, 12, 8192) ran 60.0-60.3 us in chunks of 16 against 62.5-62.7 in chunks of 8
# (three H200 calls, ws-variants-c1x3-{probe,splits-deal}-h200-2026-11-29)
ONE_CONSUMER_MIN_SPLIT = 16
MAX_CHUNKS = 64       # the most chunks of one split row (the combine kernel merges no more)


@dataclass(frozen=True, eq=False)
class WsPlan:
    """What the ws kernel and its combine kernel walk (see the module docstring).

    Per format head ``f`` (``num_heads`` of them, 1 for a shared mask):
    ``pair_ptr[f]`` indexes ``entry_key`` / ``entry_part`` (global offsets);
    ``items[f, i]`` = (pair row, begin, end, slot, shared) with ``begin..end`` inside the
    pair row's span (padding items have pair row -1); ``shared`` 0 for an ordinary item, else
    ``1 + w0``: every warpgroup works on tile row ``C p + w0``, warpgroup ``w`` on the
    entries ``begin + w, begin + w + C, ...``; warpgroups ``w > 0`` leave their partials in
    slot ``slot``'s rows of tile row ``(w0 + w) % C`` and warpgroup 0 merges them into
    tile row ``w0``'s (module doc: shared chunks); ``orders[f, order_ptr[P-1]:order_ptr[P]]``
    lists the ``items_upto[P]`` items a run covering ``P`` pair rows launches, longest
    first (a head with fewer live items is padded with items the kernel skips: pair
    row -1 or at least P);
    ``combine[f, s]`` = (pair row, first slot, chunks) of every split pair row
    (padding rows have pair row -1).
    """

    num_heads: int
    pairs: int                # pair rows of L_max: ceil(L_max / rows)
    split_tiles: int          # 0: no split
    pair_ptr: np.ndarray      # int32 [num_heads, pairs + 1]
    entry_key: np.ndarray     # int32 [n + 1]: first key of the entry's tile (+ sentinel 0)
    entry_part: np.ndarray    # int32 [C * (n + 1)]: per entry, warpgroup 0, 1 (, 2)
    bitmaps: np.ndarray       # uint64 [n_part, 64]: the format's part bitmaps, fragment order
    items: np.ndarray         # int32 [num_heads, n_items, ITEM_FIELDS]
    order_ptr: np.ndarray     # int32 [pairs + 1]: offsets of each P's order (same per head)
    orders: np.ndarray        # int32 [num_heads, order_ptr[-1]]
    items_upto: np.ndarray    # int32 [pairs + 1]: max over heads of the items with pair < P
    combine: np.ndarray       # int32 [num_heads, n_split, 3]
    slots: int                # workspace slots per (batch, head)
    tiles_per_pair: np.ndarray  # int64 [num_heads, pairs]: entries per pair row
    consumers: int = 2        # consumer warpgroups (tile rows) per block

    @property
    def rows(self) -> int:
        """Query rows per block (and per pair row): 64 per consumer warpgroup."""
        return WS_TILE * self.consumers

    def launch_items(self, seq_len: int) -> tuple[int, int]:
        """(offset into ``orders``' rows, number of items) of a run of length ``seq_len``."""
        p = min(self.pairs, -(-seq_len // self.rows))
        return int(self.order_ptr[p - 1]), int(self.items_upto[p])

    def work(self) -> int:
        """Entries over every pair row and format head (the block's tile steps)."""
        return int(self.tiles_per_pair.sum())

    @property
    def splits(self) -> bool:
        """Whether some pair row is split (the launch runs the combine kernel too)."""
        return bool((np.asarray(self.combine).reshape(-1, 3)[:, 0] >= 0).any())


def _pair_lists(fmt: MaskFormat, head: int, pair: int, consumers: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The merged entries of one pair row: keys [m] and parts [m, consumers]."""
    ptr = fmt.load_row_ptr[head]
    cols, parts = [], []
    for w in range(consumers):
        r = consumers * pair + w
        if r >= fmt.tile_rows:
            cols.append(np.zeros(0, np.int64))
            parts.append(np.zeros(0, np.int64))
            continue
        a, b = int(ptr[r]), int(ptr[r + 1])
        cols.append(np.asarray(fmt.load_col_idx[a:b], np.int64))
        parts.append(np.asarray(fmt.load_part_idx[a:b], np.int64))
    union = np.unique(np.concatenate(cols))
    out = np.full((union.size, consumers), SKIP, np.int64)
    for w in range(consumers):
        pos = np.searchsorted(union, cols[w])
        out[pos, w] = parts[w]                     # -1 (full) or the part row
    return union * fmt.tile, out


def _chunks(n: int, split_tiles: int) -> list[tuple[int, int]]:
    """Near-equal ranges of ``0..n`` of at most ``split_tiles`` entries (one if no split),
    and at most MAX_CHUNKS ranges: a row longer than ``MAX_CHUNKS * split_tiles`` entries
    (a global row past 32K keys with a split of 8) gets longer chunks, not more of them."""
    if split_tiles <= 0 or n <= split_tiles:
        return [(0, n)]
    k = min(-(-n // split_tiles), MAX_CHUNKS)
    edges = [round(i * n / k) for i in range(k + 1)]
    return list(itertools.pairwise(edges))


def item_lengths(items: np.ndarray, consumers: int) -> np.ndarray:
    """Block steps of each item ``[n, ITEM_FIELDS]``: its entries, a C-th of them (rounded
    up) for a shared chunk, whose warpgroups take every C-th entry."""
    n = (items[:, 2] - items[:, 1]).astype(np.int64)
    return np.where(items[:, 4] > 0, -(-n // consumers), n)


def _sole_warpgroup(parts: np.ndarray) -> int:
    """The one warpgroup that computes entries of ``parts`` ([m, C]), or -1 (none or several)."""
    active = np.nonzero((parts != SKIP).any(axis=0))[0]
    return int(active[0]) if active.size == 1 else -1


def consumers_of(warps: int) -> int:
    """Consumer warpgroups of a ws block of ``warps`` warps (one producer warpgroup)."""
    return warps // 4 - 1


def split_pairs(lengths: np.ndarray, split_tiles: int, split_rows: int) -> np.ndarray:
    """Which pair rows of one head (entries per pair row: ``lengths``) :func:`plan_ws`
    splits: those longer than ``split_tiles`` (none if 0), and with ``split_rows`` > 0 only
    the ``split_rows`` longest of them, the earlier row first among equal lengths (a run
    shorter than L_max launches the first pair rows, so a tail split of equal rows stays in
    it). A boolean mask over the pair rows."""
    lengths = np.asarray(lengths, np.int64)
    out = (lengths > split_tiles) if split_tiles > 0 else np.zeros(lengths.size, bool)
    if split_rows > 0 and int(out.sum()) > split_rows:
        ranked = np.lexsort((np.arange(lengths.size), -lengths))    # longest, then first
        keep = ranked[out[ranked]][:split_rows]
        out = np.zeros(lengths.size, bool)
        out[keep] = True
    return out


def plan_ws(fmt: MaskFormat, *, split_tiles: int = 0, consumers: int = 2,
            share: bool = True, split_rows: int = 0) -> WsPlan:
    """The ws kernel's walk of ``fmt`` (tile 64) for blocks of ``consumers`` warpgroups,
    with rows longer than ``split_tiles`` entries split into chunks (0: never split; with
    ``split_rows`` > 0 only that many of them per head, :func:`split_pairs`), the
    chunks one warpgroup computes alone shared (module doc; ``share=False``: none).
    Raises ValueError for another tile or consumer count."""
    if fmt.tile != WS_TILE:
        raise ValueError(f"the ws kernel walks 64x64 tiles, the format has T={fmt.tile}")
    if consumers not in CONSUMERS:
        raise ValueError(f"a ws block has 1 to 4 consumer warpgroups, not {consumers}")
    heads, pairs = fmt.num_heads, -(-fmt.seq_len // (WS_TILE * consumers))
    ptr = np.zeros((heads, pairs + 1), np.int64)
    keys: list[np.ndarray] = []
    parts: list[np.ndarray] = []
    items: list[list[tuple[int, int, int, int, int]]] = []
    combine: list[list[tuple[int, int, int]]] = []
    tiles = np.zeros((heads, pairs), np.int64)
    slots_per_head = [0] * heads
    total = 0
    for h in range(heads):
        head_items: list[tuple[int, int, int, int, int]] = []
        head_combine: list[tuple[int, int, int]] = []
        slot = 0
        lists = [_pair_lists(fmt, h, p, consumers) for p in range(pairs)]
        cut = split_pairs(np.array([k.size for k, _ in lists], np.int64), split_tiles,
                          split_rows)
        for p, (k, pt) in enumerate(lists):
            ptr[h, p] = total
            keys.append(k)
            parts.append(pt)
            n = k.size
            tiles[h, p] = n
            chunks = _chunks(n, split_tiles if cut[p] else 0)
            if len(chunks) == 1:
                head_items.append((p, total, total + n, -1, -1))     # w0 -1: not shared
            else:
                head_combine.append((p, slot, len(chunks)))
                for a, b in chunks:
                    # one consumer: every chunk is its warpgroup's own walk (nothing to share)
                    w0 = _sole_warpgroup(pt[a:b]) if share and consumers > 1 else -1
                    head_items.append((p, total + a, total + b, slot, w0))
                    slot += 1
            total += n
        # shared = 1 + w0 (the other warpgroups' partials go to the chunk's own slot)
        head_items = [(p, a, b, sl, 1 + w0 if w0 >= 0 else 0)
                      for p, a, b, sl, w0 in head_items]
        ptr[h, pairs] = total
        slots_per_head[h] = slot
        items.append(head_items)
        combine.append(head_combine)
    n_items = max(len(x) for x in items)
    n_split = max(1, max(len(x) for x in combine))
    item_arr = np.zeros((heads, n_items, ITEM_FIELDS), np.int32)
    item_arr[:, :, 0] = -1
    comb_arr = np.zeros((heads, n_split, 3), np.int32)
    comb_arr[:, :, 0] = -1
    for h in range(heads):
        if items[h]:
            item_arr[h, :len(items[h])] = items[h]
        if combine[h]:
            comb_arr[h, :len(combine[h])] = combine[h]
    # orders: for each P, the items with pair row < P, longest first (stable by position)
    upto = np.zeros(pairs + 1, np.int32)
    for p in range(1, pairs + 1):
        upto[p] = max(int((item_arr[h, :, 0][item_arr[h, :, 0] >= 0] < p).sum())
                      for h in range(heads))
    order_ptr = np.concatenate([[0], np.cumsum(upto[1:])]).astype(np.int32)
    orders = np.zeros((heads, int(order_ptr[-1])), np.int32)
    for h in range(heads):
        pair_of, length = item_arr[h, :, 0], item_lengths(item_arr[h], consumers)
        for p in range(1, pairs + 1):
            live = (pair_of >= 0) & (pair_of < p)
            idx = np.nonzero(live)[0]
            idx = idx[np.argsort(-length[idx], kind="stable")]
            rest = np.nonzero(~live)[0]                 # no work in this run: the kernel exits
            chosen = np.concatenate([idx, rest])[:upto[p]]
            orders[h, order_ptr[p - 1]:order_ptr[p]] = chosen
    entry_key = np.concatenate([*keys, [0]]).astype(np.int32)
    entry_part = np.concatenate([*(x.reshape(-1) for x in parts),
                                 [SKIP] * consumers]).astype(np.int32)
    words = fragment_bitmaps(np.asarray(fmt.part_bitmaps, dtype=np.uint64))

    def ro(a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a)
        a.setflags(write=False)
        return a

    return WsPlan(
        num_heads=heads, pairs=pairs, split_tiles=split_tiles,
        pair_ptr=ro(ptr.astype(np.int32)), entry_key=ro(entry_key), entry_part=ro(entry_part),
        bitmaps=ro(words), items=ro(item_arr), order_ptr=ro(order_ptr), orders=ro(orders),
        items_upto=ro(upto), combine=ro(comb_arr),
        slots=max(1, *slots_per_head),
        tiles_per_pair=ro(tiles), consumers=consumers)


# head_dims whose ws configs take a lean walk where the plan has one: measured +3-4% at 64
# (ws-variants-lean-cut-h200-2026-11-29), level at 128 (ws-variants-lean-cut-d128-h200-
# 2026-11-29: the step's GEMMs set the pace there); 256 not timed. Others keep the general walk
LEAN_HEAD_DIMS = (64,)


def lean_walk_applies(head_dim: int, has_bias: bool, has_key_bits: bool) -> bool:
    """Whether a node's ws configs take a lean walk where their plan has one: at
    :data:`LEAN_HEAD_DIMS`, and only without a bias or key bits, which compile the lean path
    out of the kernel (``LEAN_WALK`` in block_ws.cu.j2). A node with a key padding mask (an
    encoder fed an ``attention_mask``) therefore runs the general walk: its steps over full
    tiles of keys in the run still take the lean step, by the batch's ballot."""
    return head_dim in LEAN_HEAD_DIMS and not has_bias and not has_key_bits


def lean_walk(plan: WsPlan) -> bool:
    """Whether every entry of every walk is a full tile of each warpgroup (no part tile, no
    entry a warpgroup skips) and no item is a shared chunk. Such a plan's kernel
    (``AttentionConfig.lean_walk``) reads no walk entries in its consumers: without a bias
    or key bits, it evaluates no mask but the run's key length in a work's last step (the
    walk ascends, so no other tile can cross it). Dense rows, and block masks aligned to the
    64-key tiles walked by one consumer warpgroup (BigBird's blocks of 64). Configs take it
    where :func:`lean_walk_applies`."""
    parts = plan.entry_part[:plan.entry_part.size - plan.consumers]   # less the sentinel
    return bool((parts == FULL).all() and (plan.items[..., 4] == 0).all())


def fragment_bitmaps(words: np.ndarray) -> np.ndarray:
    """The 64x64 part tiles' bitmaps (``[n, 64]`` uint64 in the format's order: word
    ``ic * 8 + ir`` is 8x8 block (row ``ir``, key column ``ic``), bit ``8 r + c``) in the ws
    kernel's fragment order: the same 512 bytes per tile read as 128 uint32 words, word
    ``32 warp + lane`` holding what consumer thread ``(warp, lane)`` of a warpgroup tests.
    With ``g = lane // 4``, ``t4 = lane % 4``, its bit ``4 n + e`` is score ``s[n][e]`` of
    wgmma's accumulator layout: row ``16 warp + g + 8 (e // 2)``, key ``8 n + 2 t4 + e % 2``.
    One shared-memory load per tile and thread then replaces two per n8 block, and every
    test reads a bit at a constant position (block_tile.cuh ``mask_step_frag``). Inverse:
    :func:`format_bitmaps`."""
    words = np.ascontiguousarray(words, dtype="<u8").reshape(-1, 64)
    n = words.shape[0]
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    # [tile, ic, warp, e//2, g, t4, e%2]: ir = 2 warp + e//2, r = g, c = 2 t4 + e%2
    bits = bits.reshape(n, 8, 4, 2, 8, 4, 2)
    frag = bits.transpose(0, 2, 4, 5, 1, 3, 6)          # [tile, warp, g, t4 | n, e//2, e%2]
    packed = np.packbits(np.ascontiguousarray(frag).reshape(n, 128, 32), axis=-1,
                         bitorder="little")
    return np.ascontiguousarray(packed).reshape(n, 512).view("<u8").astype(np.uint64)


def format_bitmaps(frag: np.ndarray) -> np.ndarray:
    """The inverse of :func:`fragment_bitmaps`: ``[n, 64]`` uint64 in the format's order."""
    frag = np.ascontiguousarray(frag, dtype="<u8").reshape(-1, 64)
    n = frag.shape[0]
    bits = np.unpackbits(frag.view(np.uint8), bitorder="little")
    bits = bits.reshape(n, 4, 8, 4, 8, 2, 2).transpose(0, 4, 1, 5, 2, 3, 6)
    packed = np.packbits(np.ascontiguousarray(bits).reshape(n, 64, 64), axis=-1,
                         bitorder="little")
    return np.ascontiguousarray(packed).reshape(n, 512).view("<u8").astype(np.uint64)


def default_split(fmt: MaskFormat, *, batch: int, heads: int, sm_count: int,
                  consumers: int = 2, plan: WsPlan | None = None) -> int:
    """``split_tiles`` for the rows that would be the launch's critical path: 0 unless the
    longest pair row is both longer than a quarter of one SM's share of the work (``W``
    entries over every pair row, ``batch`` and ``heads``: ``W / sm_count``) and more than
    twice the mean pair row (an outlier: global tokens, BigBird's global blocks). Rows of
    similar length (windows, causal) are already balanced by the longest-first order, and
    splitting them only adds chunks and the combine (a +-256 window split at 8 ran 1.6x
    slower, ws-diag-h100-2026-11-26). At least 8 entries per chunk, so the combine's extra
    traffic stays small, and no fewer than the longest ordinary row (at most twice the
    mean), so only the outliers are split: with three consumers at B=1 8K a Longformer
    chunk of 8 split nearly every 13-entry pair row in two and the launch ran 121 us
    against 91 with two consumers (ws-variants-d64-consumers-h100-2026-11-26); with one
    consumer at least ONE_CONSUMER_MIN_SPLIT entries.
    ``plan``: ``fmt``'s unsplit walk for ``consumers``, where the caller has it already."""
    plan = plan if plan is not None else plan_ws(fmt, consumers=consumers)
    per_head = heads if fmt.num_heads == 1 else 1
    work = plan.work() * per_head * batch
    share = work / max(1, sm_count)
    tiles = plan.tiles_per_pair
    longest = int(tiles.max()) if tiles.size else 0
    mean = float(tiles.mean()) if tiles.size else 0.0
    limit = max(ONE_CONSUMER_MIN_SPLIT if consumers == 1 else MIN_SPLIT, int(share // 4))
    if longest <= limit or longest <= 2 * mean:
        return 0
    split = 1 << (limit.bit_length() - 1)           # a power of two <= limit
    ordinary = int(tiles[tiles <= 2 * mean].max())
    while split < ordinary:
        split *= 2
    return split if split < longest else 0
