"""Variants of the warp-specialised kernel timed side by side (a development probe).

Each variant starts from the selector's ws config for the shape (``ws_config``), applies
its config overrides (the row split recomputed for the consumer count), re-renders
``templates/attention/block_ws.cu.j2`` with some template values overridden (e.g.
``q_in_regs=false``: S = Q K^T reads Q from smem), compiles it for sm_90a and swaps it into
an :class:`AttentionOp` of that config, so the walk, the launch and the check are the
product's. ``--old-template attention/X.cu.j2`` adds the variant ``old`` rendered from a
copy of the template (an A/B of a template change in one call). ``--bias`` times the
kernels of a node with an additive score bias (``[1, H, L, L]`` in the case's dtype, as
T5's relative-position bias; the selector's config is the one for such a node:
``ws_cost.ws_spills``), ``--softcap X`` those that soft-cap the scores at X. Each output is
checked against a float32 reference (SDPA with the bias and the mask's -inf as its
``attn_mask``; by hand, one (batch, head) at a time, with soft-capping); a row holds
``[TF/s, relative error, us]`` per variant, and the combine kernel's own us where rows are
split.
Usage: PYTHONPATH=. python3 bench/ws_variants.py [--cases B:H:L:D:dtype ...] [--masks ...]
    [--variants base,c3,...] [--old-template ...] [--bias] [--softcap X] [--kv-heads N]
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import unittest.mock
from dataclasses import replace

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F
from attention_timing import MASKS, check_and_time, cupy_view
from triton.testing import do_bench
from ws_orders import local_orders, spread_orders

import stofc.runtime.attention as attention_rt
from stofc.codegen import render
from stofc.compile import compile_source
from stofc.kernels.attention import AttentionConfig, KernelSpec, smem_bytes, ws_launch, ws_plan
from stofc.kernels.attention.config import NO_EXTRAS, ExtraInputs
from stofc.kernels.attention.render import COMPILE_OPTIONS
from stofc.kernels.attention.residue import split_format
from stofc.kernels.attention.ws import COMBINE_GROUPS, AttentionWs
from stofc.kernels.attention.ws_cost import ws_config, ws_split, ws_stages
from stofc.kernels.attention.ws_launch import config_plan, with_lean_walk
from stofc.kernels.attention.ws_plan import WS_BLOCKS_PER_SM, consumers_of, default_split, plan_ws
from stofc.masks import encode, to_dense
from stofc.masks.decode import stats
from stofc.runtime.attention import AttentionOp
from stofc.runtime.module import BoundLaunch, load_kernel
from stofc.targets import detect

VARIANTS = {                       # name: (config overrides, template overrides)
    "base": ({}, {}),
    "c2": ({"warps": 12}, {}),                          # two consumer warpgroups
    "c3": ({"warps": 16}, {}),                          # three
    "s2": ({"stages": 2}, {}),
    "s3": ({"stages": 3}, {}),
    "s4": ({"stages": 4}, {}),
    # five stages are outside the search space (ws.WS_STAGES): pruning skipped
    "s5": ({"stages": 5}, {"__noprune__": True}),
    # deeper rings at head_dim 64 with four consumers: one Q buffer (ws_smem.ws_q_buffers)
    "s7": ({"stages": 7}, {"__noprune__": True}),
    "s8": ({"stages": 8}, {"__noprune__": True}),
    "s6": ({"stages": 6}, {}),
    "q_smem": ({}, {"q_in_regs": "false"}),
    # P's row sums by FADD trees in the softmax instead of the ones wgmma (ws.WS_ROWSUM_MMA)
    "rowsum_off": ({}, {"rowsum_mma": "false"}),
    "rowsum_on": ({}, {"rowsum_mma": "true"}),
    "no_pingpong": ({"pingpong": False}, {}),
    "pingpong": ({"pingpong": True}, {}),
    "c4": ({"warps": 20}, {}),                          # four (head_dim 64; Q from smem)
    # each count at head_dim 64 with its own ring depth (ws_cost.ws_stages), with and without
    # turns (a calibration of D64_COSTS: bench/ws_calibrate.py --column cNd)
    **{f"c{c}d{tag}": ({"warps": 4 * (c + 1), "pingpong": pp, "stages": ws_stages(64, c)}, {})
       for c in (2, 3, 4) for tag, pp in (("pp", True), ("np", False))},
    # (ws-variants-consumers-c4s6-h200 and ws-variants-32k-stages-h200, 2026-11-27, name
    # c2dpp / c3dnp / c4dnp c2s4 / c3s4 / c4s6: each count with the turns ws_pingpong gives it
    # on sparse masks)
    # each consumer count with and without ping-pong turns (a calibration of D64_COSTS)
    **{f"c{c}{tag}": ({"warps": 4 * (c + 1), "pingpong": pp}, {})
       for c in (2, 3, 4) for tag, pp in (("pp", True), ("np", False))},
    "kstep2": ({"kstep": 2, "stages": 4}, {}),
    "c2k2": ({"warps": 12, "kstep": 2, "stages": 4}, {}),   # FA4's head_dim-128 shape: 128 x 128
    # (three consumers at head_dim 128 read Q from shared memory: ws_q_in_regs; the
    # committed ws-variants-d128-c3 file names that variant "c3q", run before the product did)
    "c3_s3": ({"warps": 16, "stages": 3}, {}),
    # the selector's config rendered from --exp-template (a second template in one A/B)
    "exp": ({}, {"__exp__": True}),
    "exp_b": ({}, {"__exp__": True}),                   # a second pass of exp, same call
    # the selector's config without its lean walk (ws_plan.lean_walk: the A/B of the flag)
    "nolean": ({"lean_walk": False}, {}),
    "nolean_b": ({"lean_walk": False}, {}),
    # the producer warpgroup's register budget at 32 (four consumers: 24), with and without
    # the --exp-template
    "base_p32": ({}, {"producer_regs": 32}),
    "exp_p32": ({}, {"producer_regs": 32, "__exp__": True}),
    # head_dim 64, Q read from smem (needs --exp-template: the product's template asserts
    # Q in registers below head_dim 128), with one or two 64-key tiles per step
    "c3q": ({"warps": 16}, {"q_in_regs": "false", "__exp__": True}),
    "k2c3q": ({"warps": 16, "kstep": 2, "stages": 4}, {"q_in_regs": "false", "__exp__": True}),
    "k2c3q_s2": ({"warps": 16, "kstep": 2, "stages": 2}, {"q_in_regs": "false", "__exp__": True}),
    # the same with and without turns, four or six stages, and with the row sums by FADD
    # (an --exp-template whose two-tile step retires both GEMMs before its softmax)
    **{f"k2c3q_{tag}_s{st}": ({"warps": 16, "kstep": 2, "stages": st, "pingpong": pp},
                              {"q_in_regs": "false", "__exp__": True})
       for tag, pp in (("pp", True), ("np", False)) for st in (4, 6)},
    "k2c3q_pp_s4_b": ({"warps": 16, "kstep": 2, "stages": 4, "pingpong": True},
                      {"q_in_regs": "false", "__exp__": True}),   # a second pass, same call
    "k2c3q_np_s4_fadd": ({"warps": 16, "kstep": 2, "stages": 4, "pingpong": False},
                         {"q_in_regs": "false", "rowsum_mma": "false", "rowsum_in_pv": "false",
                          "__exp__": True}),
    # with or without the residue split of a dilated mask (the selector's ws_config decides)
    "p1": ({"period": 1}, {}),
    # split rows without shared chunks (plan_ws(share=False): every chunk on its own tile rows)
    "noshare": ({}, {"__noshare__": True}),
    # the union walk in another order than ascending key (walk_order below; full-length
    # runs only: the kernel's trim_walk assumes ascending keys)
    "ord_center": ({}, {"__order__": "center"}),
    "ord_even": ({}, {"__order__": "even"}),
    # the split rows' chunks dealt every N-th among a head's works (ws_orders.spread_orders),
    # not where longest first puts them (shared chunks: last, by per-warpgroup entries), so
    # that fewer chunks, which stream K/V for one tile row, run at once
    **{f"spread{n}": ({}, {"__deal__": n}) for n in (1, 2, 3, 4, 5, 6)},
    # every live item by the key tiles it walks (ws_orders.local_orders): a chunk runs beside
    # the band works that stream its K/V tiles, so it reads them from L2
    "local": ({}, {"__deal__": "after"}),
    "local_first": ({}, {"__deal__": "before"}),
    "p2": ({"period": 2}, {}),
    # the rows split into chunks of at most N entries (the selector's default_split otherwise)
    **{f"split{n}": ({"split": n}, {}) for n in (0, 8, 11, 12, 13, 16, 24, 32, 48, 64)},
    # one Q buffer where the product takes two (ws.ws_q_buffers): the A/B of the second
    "q1": ({}, {"q_bufs": 1}),
    # the outliers' split only, no tail split (ws_cost.tail_split) of a partial last wave
    "notail": ({"__notail__": True}, {}),
    "notail_b": ({"__notail__": True}, {}),             # a second pass of each, same call
    "base_b": ({}, {}),
    # one consumer warpgroup a block, three blocks an SM (ws_plan.WS_BLOCKS_PER_SM): no union
    # walk, no skipped steps, every warpgroup its own ring; 136 registers (Q in them); the
    # split the cost model gives one consumer, or a fixed one
    **{f"c1x3{tag}": ({"warps": 8, "stages": st, "pingpong": False,
                       **({"split": sp} if sp >= 0 else {})}, {"__occupancy__": True})
       for tag, st, sp in (("", 3, -1), ("_s2", 2, -1), ("_sp0", 3, 0), ("_sp8", 3, 8),
                           ("_sp16", 3, 16), ("_sp32", 3, 32), ("_s2sp16", 2, 16))},
    # one consumer warpgroup at head_dim 128, two blocks an SM (three do not compile there:
    # 80 registers at entry): 128 at entry, 24 / 232 after setmaxnreg, a two-stage ring (two
    # blocks of three-stage rings exceed the SM); the persistent grid 2 x SMs
    **{f"c1x2{tag}": ({"warps": 8, "stages": 2, "pingpong": False, "min_blocks": 2,
                       **({"split": sp} if sp >= 0 else {})},
                      {"__occupancy__": True, "__noprune__": True, "__blocks__": 2,
                       "consumer_regs": 232})
       for tag, sp in (("", -1), ("_sp8", 8), ("_sp16", 16), ("_sp32", 32))},
    # c1x2 with the heads in groups (the two head_dim-128 BigBird levers together;
    # --exp-template: the stream-groups patch below applied)
    **{f"c1x2_grp{n}": ({"warps": 8, "stages": 2, "pingpong": False, "min_blocks": 2},
                        {"__occupancy__": True, "__noprune__": True, "__blocks__": 2,
                         "consumer_regs": 232, "__exp__": True, "stream_group": n})
       for n in (1, 2, 4)},
    # the works of STREAM_GROUP (batch, head) streams at a time, item by item, before the
    # next group's (0: every stream, as the product); --exp-template: block_ws.cu.j2 with
    # bench/results/ws-stream-groups-tried-2026-11-29.patch applied
    **{f"grp{n}": ({}, {"__exp__": True, "stream_group": n}) for n in (0, 1, 2, 3, 4, 6, 8)},
    # the works dealt by a table: longest-processing-time first onto the least loaded block,
    # or the snake as a table; --exp-template: block_ws.cu.j2 with
    # bench/results/ws-lpt-schedule-tried-2026-11-29.patch applied (sched / sched_ptr)
    **{f"sched_{how}": ({}, {"__exp__": True, "__sched__": how}) for how in ("lpt", "snake")},
    **{f"c{c}{tag}_q1": ({"warps": 4 * (c + 1), "pingpong": pp}, {"q_bufs": 1})
       for c in (3, 4) for tag, pp in (("pp", True), ("np", False))},
}


def walk_order(keys: np.ndarray, parts: np.ndarray, how: str) -> np.ndarray:
    """A permutation of one pair row's union walk (``parts`` [m, C], SKIP where a warpgroup
    skips the entry). ``center``: by the mean index of the warpgroups that compute an entry
    (a band's global tiles move inside every warpgroup's run: each warpgroup's entries
    become one run, fewer cold starts and drains). ``even``: each warpgroup's own entries
    spread evenly over the walk (entry e's time is the mean over its warpgroups of its
    rank in that warpgroup's list, (rank + 1/2) / count): no warpgroup runs ahead of the
    ring while another computes. Ties keep the key order."""
    active = parts != ws_plan.SKIP
    c = parts.shape[1]
    if how == "center":
        idx = np.arange(c)[None, :]
        t = (active * idx).sum(1) / np.maximum(active.sum(1), 1)
    elif how == "even":
        rank = np.cumsum(active, axis=0) - 1
        count = np.maximum(active.sum(0, keepdims=True), 1)
        t = np.where(active, (rank + 0.5) / count, 0.0).sum(1) / np.maximum(active.sum(1), 1)
    else:
        raise ValueError(how)
    return np.argsort(t, kind="stable")


def dealt_plan(how):
    """ws_launch.plan_ws with another deal order: ws_orders.spread_orders for an int stride,
    ws_orders.local_orders for "after" / "before"."""
    def plan(*args, **kwargs):
        if isinstance(how, str):
            return local_orders(plan_ws(*args, **kwargs), how)
        return spread_orders(plan_ws(*args, **kwargs), how)
    return plan


def ordered_pair_lists(how: str):
    """ws_plan._pair_lists with its union walk reordered by :func:`walk_order`."""
    original = ws_plan._pair_lists

    def lists(fmt, head, pair, consumers):
        keys, parts = original(fmt, head, pair, consumers)
        perm = walk_order(keys, parts, how)
        return keys[perm], parts[perm]
    return lists


def format_order(words) -> np.ndarray:
    """The part bitmaps as the format stores them (ws_plan.fragment_bitmaps skipped)."""
    return np.asarray(words, np.uint64).reshape(-1, 64)


def base_config(fmt, profile, B: int, H: int, D: int, over: dict,
                extras: ExtraInputs = NO_EXTRAS) -> AttentionConfig:
    """The selector's ws starting config for the shape and the node's ``extras`` with
    ``over`` applied; the row split is recomputed for the consumer count the overrides give
    unless they set it."""
    cfg = ws_config(fmt, profile, batch=B, heads=H, head_dim=D, extras=extras)
    if cfg is None:
        raise ValueError("no ws config for this shape")
    over = dict(over)                       # VARIANTS' own dicts stay as they are
    notail = over.pop("__notail__", False)
    if "warps" in over and "min_blocks" not in over:    # the consumer count's resident blocks
        over["min_blocks"] = WS_BLOCKS_PER_SM[consumers_of(over["warps"])]
    cfg = replace(cfg, **over)
    walked = split_format(fmt, cfg.period)
    if "split" in over:
        cfg = replace(cfg, split_rows=over.get("split_rows", 0))
    elif notail:
        cfg = replace(cfg, split=default_split(walked, batch=B * cfg.period, heads=H,
                                               sm_count=profile.sm_count,
                                               consumers=consumers_of(cfg.warps)),
                      split_rows=0)
    else:
        split, rows = ws_split(walked, profile, consumers=consumers_of(cfg.warps),
                               batch=B * cfg.period, heads=H,
                               seq_len=-(-fmt.seq_len // cfg.period), head_dim=D)
        cfg = replace(cfg, split=split, split_rows=rows)
    # the walk's lean flag as the overridden config's plan has it ("lean_walk" in the
    # overrides forces it: a lean kernel on a walk with part tiles is refused at launch)
    return cfg if "lean_walk" in over else with_lean_walk(fmt, cfg, D)


def schedule(fmt, cfg, B: int, H: int, L: int, grid: int, how: str):
    """(sched, sched_ptr) as int32 arrays: each block's works in launch order. ``lpt``:
    every work, in launch order (longest first), onto the block with the least load so far
    (ties: the lower block), a work costing 2 per walk entry and 3 (its Q wait and epilogue,
    about 1.5 steps in ws-trace-h200-2026-11-29); ``snake``: ws_work_index's deal."""
    plan = config_plan(fmt, cfg)
    off, n = plan.launch_items(-(-L // cfg.period))
    streams = H * B * cfg.period
    n_work = streams * n
    per_block: list[list[int]] = [[] for _ in range(grid)]
    if how == "snake":
        for b in range(grid):
            k = 0
            while (w := k * grid + (grid - 1 - b if k & 1 else b)) < n_work:
                per_block[b].append(w)
                k += 1
    else:
        heap = [(0, b) for b in range(grid)]
        for w in range(n_work):
            h, idx = w % H, w // streams
            it = plan.items[h % plan.items.shape[0], plan.orders[h % plan.orders.shape[0], off + idx]]
            cost = 2 * int(it[2] - it[1]) + 3
            load, b = heapq.heappop(heap)
            per_block[b].append(w)
            heapq.heappush(heap, (load + cost, b))
    ptr = np.concatenate([[0], np.cumsum([len(x) for x in per_block])]).astype(np.int32)
    return (cp.asarray(np.concatenate([np.asarray(x, np.int32) for x in per_block])),
            cp.asarray(ptr))


def reference(q, k, v, dense, bias, softcap: float):
    """The float32 attention ``[B, L, H, D]`` of ``q, k, v`` (``[B, L, H, D]``) under the
    bool mask ``dense``, with the additive ``bias`` (``[1, H, L, L]``, or None) and the
    scores soft-capped at ``softcap`` (0: not), as the kernel computes it: soft-capping of
    the scaled scores, then the bias, then the mask."""
    qt, kt, vt = (x.transpose(1, 2).float() for x in (q, k, v))
    if not softcap:
        mask = dense if bias is None else bias.float().masked_fill_(~dense, float("-inf"))
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    out = torch.empty_like(qt)
    scale = qt.shape[-1] ** -0.5
    for b, h in itertools.product(range(qt.shape[0]), range(qt.shape[1])):
        s = softcap * torch.tanh(qt[b, h] @ kt[b, h].T * scale / softcap)
        if bias is not None:
            s += bias[0, h].float()
        out[b, h] = torch.softmax(s.masked_fill_(~dense, float("-inf")), -1) @ vt[b, h]
    return out.transpose(1, 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1:16:8192:128:bf16 2:12:8192:64:fp16")
    ap.add_argument("--masks", default="dense,causal")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--old-template", default="",
                    help="a copy of block_ws.cu.j2 (under templates/) timed as variant 'old'")
    ap.add_argument("--old-format-bitmaps", action="store_true",
                    help="variant 'old' gets the part bitmaps in the format's order (templates "
                         "from before the fragment order of plan layout 7)")
    ap.add_argument("--no-ref", action="store_true",
                    help="skip the float32 reference (lengths whose dense mask would not fit)")
    ap.add_argument("--exp-template", default="",
                    help="a template copy (under templates/) for the variants marked __exp__; "
                         "their configs skip the register-estimate pruning")
    ap.add_argument("--bias", action="store_true",
                    help="the node adds a bias [1, H, L, L] (the case's dtype) to the scores: "
                         "its kernels, and the selector's config for it (base)")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="the node soft-caps the scores at this value (0: not)")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="K/V heads (grouped-query attention; 0: one per query head): with 1, "
                         "every head reads the same K/V, which an A/B of memory traffic needs")
    args = ap.parse_args()
    extras = ExtraInputs(has_bias=args.bias, has_softcap=args.softcap > 0)
    if args.old_template:
        VARIANTS["old"] = ({}, {"__template__": args.old_template,
                                "__format_bitmaps__": args.old_format_bitmaps})
    profile = detect()
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    names = args.variants.split(",")
    for case in args.cases.split():
        B, H, L, D, dt = case.split(":")
        B, H, L, D = int(B), int(H), int(L), int(D)
        tdt = torch.bfloat16 if dt == "bf16" else torch.float16
        sdt = "bfloat16" if dt == "bf16" else "float16"
        hkv = args.kv_heads or H
        q = torch.randn(B, L, H, D, device="cuda", dtype=tdt)
        k, v = (torch.randn(B, L, hkv, D, device="cuda", dtype=tdt) for _ in range(2))
        qc, kc, vc = (cupy_view(x) for x in (q, k, v))
        bias = torch.randn(1, H, L, L, device="cuda", dtype=tdt) if args.bias else None
        extra_args = {"bias": None if bias is None else cupy_view(bias), "softcap": args.softcap}
        for mask in args.masks.split(","):
            fmt = encode(MASKS.get(mask, mask), L)
            if args.no_ref:                     # timing only (the error column is nan)
                nnz, ref = stats(fmt).nnz, None
            else:
                dense = torch.from_numpy(to_dense(fmt)).cuda()
                nnz = int(dense.sum())
                ref = reference(q, k.repeat_interleave(H // hkv, 2),
                                v.repeat_interleave(H // hkv, 2), dense, bias, args.softcap)
                del dense
            row = {"case": case, "mask": mask}
            if args.bias or args.softcap:
                row.update(bias=args.bias, softcap=args.softcap)
            for name in names:
                cfg_over, tpl_over = VARIANTS[name]
                # one consumer's blocks an SM where a variant sets them (the grid, the split's cost)
                blocks = {1: tpl_over.get("__blocks__", ws_plan.WS_BLOCKS_PER_SM[1])}
                with unittest.mock.patch.dict(ws_plan.WS_BLOCKS_PER_SM, blocks):
                    try:
                        cfg = base_config(fmt, profile, B, H, D, cfg_over, extras)
                        tpl_over = dict(tpl_over)
                        occupancy = tpl_over.pop("__occupancy__", False)
                        sched = tpl_over.pop("__sched__", None)
                        tpl_over.pop("__blocks__", None)
                        if tpl_over.pop("__format_bitmaps__", False):
                            with unittest.mock.patch.object(ws_plan, "fragment_bitmaps", format_order):
                                op = AttentionOp(fmt, cfg, sdt, D, profile)
                        elif tpl_over.pop("__noprune__", False):
                            with unittest.mock.patch.object(attention_rt, "prune", lambda *a: None):
                                op = AttentionOp(fmt, cfg, sdt, D, profile)
                        elif "__order__" in tpl_over:
                            with unittest.mock.patch.object(
                                    ws_plan, "_pair_lists", ordered_pair_lists(tpl_over.pop("__order__"))):
                                op = AttentionOp(fmt, cfg, sdt, D, profile)
                        elif "__deal__" in tpl_over:
                            with unittest.mock.patch.object(
                                    ws_launch, "plan_ws", dealt_plan(tpl_over.pop("__deal__"))):
                                op = AttentionOp(fmt, cfg, sdt, D, profile)
                        elif tpl_over.pop("__noshare__", False):
                            with unittest.mock.patch.object(
                                    ws_launch, "plan_ws", functools.partial(plan_ws, share=False)):
                                op = AttentionOp(fmt, cfg, sdt, D, profile)
                        elif tpl_over.pop("__exp__", False):
                            tpl_over["__template__"] = args.exp_template
                            with unittest.mock.patch.object(attention_rt, "prune", lambda *a: None):
                                op = AttentionOp(fmt, cfg, sdt, D, profile)
                        else:
                            op = AttentionOp(fmt, cfg, sdt, D, profile)
                        spec = KernelSpec(cfg, sdt, D, has_bias=extras.has_bias,
                                          has_softcap=extras.has_softcap)
                        values = {**AttentionWs().template_values(spec), **tpl_over}
                        values["kernel_name"] = spec.name
                        template = values.pop("__template__", spec.template)
                        src = render(template, spec.name + "_" + name,
                                     (spec.name, spec.name + "_combine"), **values)
                        compiled = compile_source(src, "sm_90a", options=COMPILE_OPTIONS)
                        op._kernels[(extras.has_bias, False, extras.has_softcap)] = (
                            load_kernel(compiled, spec.name, dynamic_smem=smem_bytes(cfg, D),
                                        shared_blocks=cfg.min_blocks),
                            load_kernel(compiled, spec.name + "_combine"))
                        out = torch.full_like(q, float("nan"))
                        bound = op.bind(qc, kc, vc, cupy_view(out), **extra_args)
                        if sched:                       # the deal's table after n_work
                            bound = BoundLaunch(bound.kernel, bound.grid, bound.block,
                                                (*bound._keep, *schedule(fmt, cfg, B, H, L,
                                                                         bound.grid, sched)),
                                                result=bound.result, then=bound.then)
                        if occupancy:                   # blocks an SM holds (the driver's count)
                            fn = op._kernels[(extras.has_bias, False, extras.has_softcap)][0].function
                            drv = cp.cuda.driver
                            try:
                                row[name + "_occ"] = drv.occupancyMaxActiveBlocksPerMultiprocessor(
                                    fn.ptr, bound.block, smem_bytes(cfg, D))
                            except Exception as e:           # recorded, not fatal
                                row[name + "_occ"] = repr(e)[:80]
                        if bound.then is not None and "COMBINE_GROUPS" not in src.code:
                            bound.then.grid //= COMBINE_GROUPS   # a template from before 11-26's combine
                        row[name] = check_and_time(bound, stream, out, ref, 4 * B * H * D * nnz)
                        if bound.then is not None:      # the combine kernel alone, us
                            row[name] += (round(1e3 * do_bench(lambda c=bound.then: c.launch(stream),
                                                               warmup=25, rep=100,
                                                               return_mode="median"), 1),)
                    except Exception as e:  # recorded: a variant may not compile or fit
                        row[name] = repr(e)[:160]
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
