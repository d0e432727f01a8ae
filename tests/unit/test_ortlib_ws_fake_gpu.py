"""The warp-specialised kernel's CUDA-twin launches in ONNX Runtime, without a GPU.

The test build of ``libstofc_ort.so`` runs SparseAttention nodes whose kernel is a
``stofc_attn_ws_...`` entry against ``cuda/ort/tests/fake_cuda.cc``: a recording
driver whose ``cuTensorMapEncodeTiled`` writes its arguments into the map. Python's
``stofc.runtime.tensor_map`` is pointed at the same fake library, so ``WsLaunchData.bind``
(``AttentionOp`` on the CPU with numpy for CuPy) encodes its maps through it too. Each
run must launch exactly what ``bind`` launches: the main kernel (persistent grid of
``WS_BLOCKS_PER_SM`` blocks an SM, ``128 * (consumers + 1)`` threads, dynamic shared
memory, every scalar, the plan's device arrays, the q/k/v tensor maps for separate and
packed QKV and grouped-query K/V), then the combine kernel when the plan splits rows,
after the key-prep kernel and nothing else; later runs upload and load nothing. A kernel
of three blocks an SM (one consumer warpgroup) is loaded with the largest shared-memory
carveout, others with the driver's. Mismatched plan and kernel kinds, and ws launch
attributes other than the kernel's, fail session creation with one line.
"""

from __future__ import annotations

import ctypes
import itertools
import types
from dataclasses import replace

import numpy as np
import pytest
from onnx import TensorProto, helper

import stofc.runtime.attention as rt
import stofc.runtime.attention_ws as rws
from stofc.kernels.attention import AttentionConfig, KernelSpec
from stofc.kernels.attention.launch import launch_data
from stofc.kernels.attention.ws import ws_consumers
from stofc.kernels.attention.ws_plan import WS_BLOCKS_PER_SM
from stofc.lower.twins import KERNEL_ABI
from stofc.masks import encode
from stofc.package.maskbin import write_attention_plan, write_mask_binary
from stofc.runtime import tensor_map
from stofc.targets import get_profile
from tests.unit.test_ortlib_abi import FAKE_CUPY, _Recorder, abi_table
from tests.unit.test_ortlib_fake_gpu import device_array, make_model, run
from tests.unit.test_ortlib_ws import launch_numbers, per_head_format, ws

F16 = TensorProto.FLOAT16
D = 64
WS_NAMES = dict(abi_table("STOFC_ATTENTION_WS_ABI"))
COMBINE_NAMES = dict(abi_table("STOFC_ATTENTION_WS_COMBINE_ABI"))
# the fake driver's CUtensorMap: its cuTensorMapEncodeTiled arguments (fake_cuda.cc)
FAKE_MAP = np.dtype([("tag", "<u4"), ("dtype", "<u4"), ("rank", "<u4"), ("interleave", "<u4"),
                     ("swizzle", "<u4"), ("l2", "<u4"), ("oob", "<u4"), ("pad", "<u4"),
                     ("address", "<u8"), ("dims", "<u8", 4), ("strides", "<u8", 3),
                     ("box", "<u4", 4), ("element_strides", "<u4", 4)])
PLAN_ARRAYS = {"entry_key": np.int32, "entry_part": np.int32, "bitmaps": np.uint64,
               "items": np.int32, "item_order": np.int32}
# cuda.h: CUfunction_attribute CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, and
# CU_SHAREDMEM_CARVEOUT_MAX_SHARED (the whole unified L1 / shared memory as shared)
CARVEOUT_ATTR, CARVEOUT_MAX_SHARED = 9, 100
# one consumer warpgroup: 256 threads, three blocks an SM (ws_plan.WS_BLOCKS_PER_SM)
WS1 = AttentionConfig("ws", 64, 16, 8, 2, 1, min_blocks=3, mma="wgmma", split=8, pingpong=False)


FAKE_MAP_TAG = 0x50414D54           # "TMAP": written by the fake encoder (logged as tag 1)


def decode_map(m: tensor_map.TensorMap) -> dict:
    """A map Python encoded through the fake driver, as the fake logs a launch's maps."""
    rec = np.frombuffer(m.data, FAKE_MAP)[0]
    out = {name: (rec[name].tolist() if rec[name].ndim else int(rec[name]))
           for name in FAKE_MAP.names if name != "pad"}
    out["tag"] = int(out["tag"] == FAKE_MAP_TAG)
    return out


@pytest.fixture
def ws_runtime(monkeypatch, fake):
    """WsLaunchData on the CPU, encoding its tensor maps through the fake driver."""
    cupy = types.SimpleNamespace(**vars(FAKE_CUPY), float32=np.float32)
    monkeypatch.setattr(rt, "_cupy", lambda: cupy)
    monkeypatch.setattr(rt, "device_arch", lambda: "sm_90")
    monkeypatch.setattr("stofc.runtime.launches.BoundLaunch", _Recorder)
    monkeypatch.setattr(rws, "BoundLaunch", _Recorder)
    monkeypatch.setattr(tensor_map, "_LIBCUDA", ctypes.CDLL(str(fake["fake"])))


def ws_package(pkg, fmt, config, *, H=2, Hkv=None, kpm=False, bias=False, packed=False,
               plan_config=None, **override):
    """A one-node package: mask.bin, the plan of ``plan_config`` (default ``config``), a
    placeholder cubin named for ``config``'s kernel, and the node's CUDA attributes."""
    Hkv = Hkv or H
    write_mask_binary(fmt, pkg / "mask.bin")
    write_attention_plan(launch_data(fmt, plan_config or config), pkg / "a.plan.bin")
    kspec = KernelSpec(config, "float16", D, has_bias=bias, has_key_bits=kpm)
    (pkg / "k.cubin").write_bytes(b"not a real cubin: the fake driver only records\0")
    threads, per_row, smem = launch_numbers(config, D)
    attrs = dict(num_heads=H, head_dim=D, scale=0.125, mask_file="mask.bin",
                 kernel=f"k.cubin:{kspec.name}", kernel_abi=KERNEL_ABI, launch_plan="a.plan.bin",
                 block_threads=threads, blocks_per_tile_row=per_row, smem_bytes=smem)
    if Hkv != H:
        attrs["kv_num_heads"] = Hkv
    attrs.update(override)
    names = ["qkv", "", ""] if packed else ["q", "k", "v"]
    names += ["kpm" if kpm else "", "bias" if bias else ""]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("SparseAttention", names, ["out"], domain="ai.stofc",
                            **{k: v for k, v in attrs.items() if v is not None})
    if packed:
        inputs = [helper.make_tensor_value_info("qkv", F16, ["B", "S", (H + 2 * Hkv) * D])]
    else:
        inputs = [helper.make_tensor_value_info(n, F16, ["B", "S", h * D])
                  for n, h in (("q", H), ("k", Hkv), ("v", Hkv))]
    if kpm:
        inputs.append(helper.make_tensor_value_info("kpm", TensorProto.INT64, ["B", "S"]))
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", F16, [1, H, "S", "S"]))
    return make_model(node, inputs, [helper.make_tensor_value_info("out", F16, ["B", "S", H * D])])


def ws_feeds(rng, B, S, H, Hkv, *, kpm, bias, packed):
    q, k, v = (rng.standard_normal((B, S, h * D)).astype(np.float16) for h in (H, Hkv, Hkv))
    f = {"qkv": np.concatenate([q, k, v], axis=-1)} if packed else {"q": q, "k": k, "v": v}
    if kpm:
        m = np.ones((B, S), np.int64)
        m[-1, S // 2:] = 0
        m[0, 3] = 0
        f["kpm"] = m
    if bias:
        f["bias"] = rng.standard_normal((1, H, S, S)).astype(np.float16)
    return f


def views(f, B, S, H, Hkv, packed):
    """q, k, v of one feed as [B, S, heads, D] arrays (strided views of the packed input)."""
    if packed:
        x = f["qkv"]
        return (x[..., :H * D].reshape(B, S, H, D), x[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D),
                x[..., (H + Hkv) * D:].reshape(B, S, Hkv, D))
    return f["q"].reshape(B, S, H, D), f["k"].reshape(B, S, Hkv, D), f["v"].reshape(B, S, Hkv, D)


def per_run(records):
    runs = [i for i, r in enumerate(records) if r["call"] == "run"] + [len(records)]
    return [records[a:b] for a, b in itertools.pairwise(runs)]


def check_ws_launches(records, recs, fmt, config, f, B, S, H, Hkv, *, packed, sm_count=132):
    """The run's launches (after key_prep) are what WsLaunchData.bind launches on a GPU of
    ``sm_count`` SMs (the fake driver's $STOFC_FAKE_SM_COUNT)."""
    profile = replace(get_profile("h100"), sm_count=sm_count)
    op = rt.AttentionOp(fmt, config, "float16", D, profile=profile)
    op._kernel = lambda *flags: ("main", "combine")      # the main kernel, then the combine
    q, k, v = views(f, B, S, H, Hkv, packed)
    kw = {"scale": 0.125}
    if "kpm" in f:
        kw["key_mask"] = f["kpm"]
    if "bias" in f:
        kw["bias"] = f["bias"]
    want = op.bind(q, k, v, **kw)
    w = dict(zip(WS_NAMES, want.args, strict=True))
    launches = [r for r in recs if r["call"] == "launch"]
    prep, main, *rest = launches
    assert prep["fn"] == "stofc_key_prep" and prep["grid"] == [B, 1, 1]
    spec = KernelSpec(config, "float16", D, has_bias="bias" in f, has_key_bits="kpm" in f)
    assert main["fn"] == spec.name
    consumers = ws_consumers(config)
    assert main["grid"] == [want.grid, 1, 1]
    assert main["block"] == [128 * (consumers + 1), 1, 1] == [want.block, 1, 1]
    # persistent: WS_BLOCKS_PER_SM blocks on each SM at most (three with one consumer)
    assert want.grid == min(int(w["n_work"]), sm_count * WS_BLOCKS_PER_SM[consumers])
    assert main["smem"] == launch_numbers(config, D)[2]
    a = main["args"]
    for name, kind in WS_NAMES.items():
        if kind in ("i32", "i64", "f32"):
            assert float(a[name]) == pytest.approx(float(w[name]), rel=1e-6), name
    # the tensor maps: every encode argument as Python's encode_tiled passes it, at the
    # same places relative to q (packed: K and V inside q's rows)
    got_maps = [a["tma_q"], a["tma_k"], a["tma_v"]]
    want_maps = [decode_map(w[n]) for n in ("tma_q", "tma_k", "tma_v")]
    for g, e, x in zip(got_maps, want_maps, (q, k, v), strict=True):
        assert g["tag"] == 1 and e["tag"] == 1
        assert {n: g[n] for n in g if n != "address"} == {n: e[n] for n in e if n != "address"}
        assert e["address"] == x.__array_interface__["data"][0]
        assert (g["dtype"], g["rank"], g["box"], g["element_strides"]) == (6, 4, [64, 1, 64, 1],
                                                                           [1, 1, 1, 1])
        assert (g["interleave"], g["swizzle"], g["l2"], g["oob"]) == (0, 3, 2, 0)
    assert [m["dims"] for m in got_maps] == [[D, H, S, B], [D, Hkv, S, B], [D, Hkv, S, B]]
    row = (H + 2 * Hkv) * D if packed else None
    for m, heads in zip(got_maps, (H, Hkv, Hkv), strict=True):
        ss = row or heads * D
        assert m["strides"] == [2 * D, 2 * ss, 2 * ss * S]
    base = got_maps[0]["address"]
    offsets = [m["address"] - base for m in got_maps]
    if packed:
        assert offsets == [0, 2 * H * D, 2 * (H + Hkv) * D]
    else:
        assert len(set(offsets)) == 3
    # the plan's device arrays as WsLaunchData uploads them (orders from the run's offset)
    for name, dtype in PLAN_ARRAYS.items():
        expect = np.asarray(w[name]).ravel()
        assert np.array_equal(device_array(records, a[name], dtype, expect.size), expect), name
    assert a["kv_len_values"] == np.asarray(w["kv_len"]).tolist()
    if "kpm" in f:
        assert [int(x) for x in a["key_bits_values"]] == np.asarray(w["key_bits"]).ravel().tolist()
    assert a["o"] != base and a["bias"] != 0
    if want.then is None:
        assert rest == [] and a["part_o"] == 0 and a["part_ml"] == 0
        return
    (comb,) = rest                                       # the combine kernel, right after
    cw = dict(zip(COMBINE_NAMES, want.then.args, strict=True))
    c = comb["args"]
    assert comb["fn"] == f"{spec.name}_combine"
    assert comb["grid"] == [want.then.grid, 1, 1] and comb["block"] == [256, 1, 1]
    assert comb["smem"] == 0
    for name, kind in COMBINE_NAMES.items():
        if kind != "ptr":
            assert int(c[name]) == int(cw[name]), name
    assert (c["o"], c["part_o"], c["part_ml"]) == (a["o"], a["part_o"], a["part_ml"])
    expect = np.asarray(cw["combine"]).ravel()
    assert np.array_equal(device_array(records, c["combine"], np.int32, expect.size), expect)
    # the workspace: part_o then part_ml in one scratch block, each big enough
    part_o_bytes = np.asarray(w["part_o"]).nbytes
    assert a["part_o"] != 0 and a["part_ml"] - a["part_o"] >= part_o_bytes
    assert (a["part_ml"] - a["part_o"]) % 256 == 0


CASES = [  # id, format, config, H, Hkv, kpm, bias, packed, SMs
    ("split-kpm-bias", lambda: encode("longformer:window=64,global=16", 1024), ws(split=8),
     2, 2, True, True, False, 132),
    ("split-packed", lambda: encode("longformer:window=64,global=16", 1024), ws(split=8, stages=3),
     2, 2, False, False, True, 5),
    ("gqa-nosplit", lambda: encode("causal", 512), ws(kstep=2, stages=4), 4, 2, True, False, False,
     132),
    ("gqa-packed", lambda: encode("causal", 512), ws(split=4 * 2), 4, 1, False, False, True, 3),
    ("per-head-split", lambda: per_head_format(700), ws(split=8), 2, 2, True, False, False, 16),
    # the tail split: one pair row cut, the others written directly
    ("tail-split", lambda: encode("dense", 1024), replace(ws(split=8), split_rows=1),
     2, 2, True, False, False, 132),
    # one consumer warpgroup: 256 threads, up to three blocks an SM
    ("one-consumer", lambda: encode("longformer:window=64,global=16", 1024), WS1,
     2, 2, True, False, False, 5),
]


@pytest.mark.parametrize("name,make_fmt,config,H,Hkv,kpm,bias,packed,sms", CASES,
                         ids=[c[0] for c in CASES])
def test_ws_launch_equals_ws_launch_data(fake, ws_runtime, tmp_path, name, make_fmt, config,
                                         H, Hkv, kpm, bias, packed, sms):
    fmt = make_fmt()
    model = ws_package(tmp_path, fmt, config, H=H, Hkv=Hkv, kpm=kpm, bias=bias, packed=packed)
    rng = np.random.default_rng(0)
    shapes = [(2, fmt.seq_len - 37), (1, 70), (1, fmt.seq_len), (3, 129)]
    feeds = [ws_feeds(rng, B, S, H, Hkv, kpm=kpm, bias=bias, packed=packed) for B, S in shapes]
    code, out, records = run(fake, tmp_path, model, feeds, STOFC_FAKE_SM_COUNT=str(sms))
    assert code == 0, out
    runs = per_run(records)
    first = runs[0]
    assert [r["call"] for r in first].count("mem_alloc") == 1          # the plan, once
    assert [r["call"] for r in first].count("module_load") == 2         # key_prep + the ws module
    for recs in runs[1:]:
        assert not [r for r in recs if r["call"] in ("mem_alloc", "htod", "module_load")]
    for recs in runs:                                                   # at most q, k, v per run
        assert len([r for r in recs if r["call"] == "tensor_map"]) <= 3
    plan = launch_data(fmt, config)
    assert any(len([r for r in recs if r["call"] == "launch"]) == 3 for recs in runs) == plan.splits
    assert [r["value"] for r in records if r["call"] == "device_attr"] == [sms]   # asked once
    for (B, S), f, recs in zip(shapes, feeds, runs, strict=True):
        check_ws_launches(records, recs, fmt, config, f, B, S, H, Hkv, packed=packed,
                          sm_count=sms)


@pytest.mark.parametrize("env,pdl", [({}, True), ({"STOFC_FAKE_PTX_VERSION": "80"}, False),
                                     ({"STOFC_NO_PDL": "1"}, False), ({"STOFC_NO_PDL": "0"}, True)],
                         ids=["sm90_ptx", "sm80_ptx", "no_pdl", "no_pdl_0"])
def test_ws_kernels_launch_with_pdl_when_their_ptx_waits(fake, ws_runtime, tmp_path, env, pdl):
    """The main and combine kernels wait on their grid dependency (pdl.cuh), so the twin
    launches both with programmatic stream serialization when their PTX is compute_90 or newer
    (the fake reports $STOFC_FAKE_PTX_VERSION, default 90) unless $STOFC_NO_PDL is set (not
    "0"); KeyPrep, whose kernel does not wait, never."""
    fmt = encode("longformer:window=64,global=16", 1024)
    config = ws(split=8)
    assert launch_data(fmt, config).splits                              # a combine follows
    model = ws_package(tmp_path, fmt, config, kpm=True)
    f = ws_feeds(np.random.default_rng(5), 1, 1024, 2, 2, kpm=True, bias=False, packed=False)
    code, out, records = run(fake, tmp_path, model, [f, f], **env)
    assert code == 0, out
    launches = [r for r in records if r["call"] == "launch"]
    ws_launches = [r for r in launches if r["fn"].startswith("stofc_attn_ws_")]
    assert len(ws_launches) == 4                                        # main + combine, twice
    assert [r["pdl"] for r in ws_launches] == [pdl] * 4
    assert [r["pdl"] for r in launches if r["fn"] == "stofc_key_prep"] == [False, False]


@pytest.mark.parametrize("config,blocks_per_sm", [(WS1, 3), (ws(split=8), 1)],
                         ids=["one-consumer", "two-consumers"])
def test_ws_grid_and_carveout_follow_blocks_per_sm(fake, tmp_path, config, blocks_per_sm):
    """One consumer warpgroup: a persistent grid of min(n_work, 3 SMs) blocks of 256 threads,
    and the main kernel asks for the largest shared-memory carveout (three blocks share an
    SM's shared memory) once, when its module is loaded, not per launch. Wider blocks: one
    block an SM and the driver's carveout."""
    fmt = encode("longformer:window=64,global=16", 1024)
    assert WS_BLOCKS_PER_SM[ws_consumers(config)] == blocks_per_sm
    model = ws_package(tmp_path, fmt, config, kpm=True)
    rng = np.random.default_rng(7)
    shapes = [(2, 1024), (1, 60)]                        # n_work above 3 x 5 SMs, below 5
    feeds = [ws_feeds(rng, B, S, 2, 2, kpm=True, bias=False, packed=False) for B, S in shapes]
    sms = 5
    code, out, records = run(fake, tmp_path, model, feeds, STOFC_FAKE_SM_COUNT=str(sms))
    assert code == 0, out
    threads = 128 * (ws_consumers(config) + 1)
    main_fn = KernelSpec(config, "float16", D, has_key_bits=True).name
    grids = []
    for recs in per_run(records):
        (main,) = [r for r in recs if r["call"] == "launch" and r["fn"] == main_fn]
        n_work = int(main["args"]["n_work"])
        assert main["grid"] == [min(n_work, blocks_per_sm * sms), 1, 1]
        assert main["block"] == [threads, 1, 1]
        grids.append((n_work, main["grid"][0]))
    assert any(n > 3 * sms for n, _ in grids) and any(n <= sms for n, _ in grids)
    carveouts = [r for r in records if r["call"] == "func_attr" and r["attr"] == CARVEOUT_ATTR]
    if blocks_per_sm > 1:              # once: on the main kernel, when its module is loaded
        assert [(r["fn"], r["value"]) for r in carveouts] == [(main_fn, CARVEOUT_MAX_SHARED)]
        calls = [(r["call"], r.get("fn")) for r in per_run(records)[0]]
        assert calls.index(("func_attr", main_fn)) < calls.index(("launch", main_fn))
    else:
        assert carveouts == []


def test_repeated_buffers_reuse_their_tensor_maps(fake, tmp_path):
    """Runs on buffers already seen encode no map again (cached by address and shape): ORT's
    CPU EP hands the kernel the fed numpy arrays, so three runs on one feed encode q, k and
    v once, and every launch passes those maps."""
    fmt = encode("causal", 256)
    model = ws_package(tmp_path, fmt, ws(), kpm=False)
    f = ws_feeds(np.random.default_rng(1), 1, 256, 2, 2, kpm=False, bias=False, packed=False)
    code, out, records = run(fake, tmp_path, model, [f, f, f])
    assert code == 0, out
    runs = per_run(records)
    maps = [[r["map"] for r in recs if r["call"] == "tensor_map"] for recs in runs]
    assert [len(m) for m in maps] == [3, 0, 0]
    for recs in runs:
        (main,) = [r for r in recs if r["call"] == "launch" and r["fn"] != "stofc_key_prep"]
        assert [main["args"][t] for t in ("tma_q", "tma_k", "tma_v")] == maps[0]


def test_ws_variant_next_to_a_block_base(fake, ws_runtime, tmp_path):
    """A bucketed node: the ws kernel for S <= 256, the block-wise base above."""
    from tests.unit.test_ortlib_variants import check_launch

    fmt = encode("longformer:window=64,global=16", 512)
    base, var = AttentionConfig("block", 64, 16, 4, 2, 1), ws(split=8)
    write_attention_plan(launch_data(fmt, var), tmp_path / "w.plan.bin")
    (tmp_path / "v.cubin").write_bytes(b"fake ws cubin\0")
    threads, per_row, smem = launch_numbers(var, D)
    model = ws_package(
        tmp_path, fmt, base, kpm=True,
        variant_kernels=f"v.cubin:{KernelSpec(var, 'float16', D, has_key_bits=True).name}",
        variant_launch_plans="w.plan.bin", variant_block_threads=[threads],
        variant_blocks_per_tile_row=[per_row], variant_smem_bytes=[smem],
        variant_max_seq_len=[256], variant_max_batch_rows=[0])
    rng = np.random.default_rng(3)
    shapes = [(2, 200), (1, 512), (1, 256)]
    feeds = [ws_feeds(rng, B, S, 2, 2, kpm=True, bias=False, packed=False) for B, S in shapes]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    runs = per_run(records)
    assert [r["call"] for r in runs[0]].count("module_load") == 3       # key_prep, block, ws
    assert [r["call"] for r in runs[0]].count("mem_alloc") == 2         # both plans
    ws_smem = [r for r in runs[0] if r["call"] == "func_attr" and r["fn"].startswith("stofc_attn_ws")]
    assert ws_smem and ws_smem[0]["value"] == smem
    for (B, S), f, recs in zip(shapes, feeds, runs, strict=True):
        if S <= 256:
            check_ws_launches(records, recs, fmt, var, f, B, S, 2, 2, packed=False)
        else:
            (attn,) = [r for r in recs if r["call"] == "launch" and r["fn"] != "stofc_key_prep"]
            q, k, v = views(f, B, S, 2, 2, False)
            check_launch(records, attn, fmt, base, q, k, v, f["kpm"])


def fake_error(fake, tmp_path, model) -> str:
    from tests.unit.test_ortlib_variants import fake_error as one_line
    return one_line(fake, tmp_path, model)


BLOCK = AttentionConfig("block", 64, 16, 4, 2, 1)
BAD = [  # (kernel config, plan config, override, message)
    (ws(), BLOCK, {}, "a.plan.bin' is for a block-wise kernel but 'kernel' names "
                      "stofc_attn_ws_f16_d64_t64_w12_m16_s2_q1_o1_pp_b0_k0, a warp-specialised "
                      "kernel"),
    (BLOCK, ws(), {}, "is for a warp-specialised kernel but 'kernel' names "
                      "stofc_attn_block_f16_d64_t64_w4_m16_s2_q1_o1_b0_k0, a block-wise kernel"),
    (ws(), ws(), {"blocks_per_tile_row": 2}, "attribute 'blocks_per_tile_row' = 2 but a "
                                             "warp-specialised kernel takes 1"),
    (ws(), ws(), {"block_threads": 768}, "attribute 'block_threads' = 768 but a warp-specialised "
                                         "kernel runs 256, 384, 512 or 640 threads"),
    (ws(), ws(consumers=3), {}, "attribute 'block_threads' = 384 but launch plan"),
    (ws(consumers=3), ws(), {}, "attribute 'block_threads' = 512 but launch plan"),
    (ws(), WS1, {}, "attribute 'block_threads' = 384 but launch plan"),
    (WS1, ws(), {}, "attribute 'block_threads' = 256 but launch plan"),
    (ws(), ws(), {"smem_bytes": 0}, "attribute 'smem_bytes' is required (> 0) for a "
                                    "warp-specialised attention kernel"),
    (ws(), ws(), {"head_dim": 128, "kernel": "k.cubin:stofc_attn_ws_f16_d64_t64_w12_m16_s2_q1_o1_pp_b0_k0"},
     "compiled for head_dim 64, but the node's head_dim is 128"),
]


@pytest.mark.parametrize("kernel,plan,override,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_bad_ws_nodes_fail_session_creation(fake, tmp_path, kernel, plan, override, message):
    model = ws_package(tmp_path, encode("causal", 256), kernel, plan_config=plan, **override)
    line = fake_error(fake, tmp_path, model)
    assert "stofc SparseAttention" in line and message in line, line


def test_ws_variant_with_a_block_plan_names_the_variant(fake, tmp_path):
    fmt = encode("causal", 256)
    write_attention_plan(launch_data(fmt, BLOCK), tmp_path / "b.plan.bin")
    (tmp_path / "v.cubin").write_bytes(b"fake\0")
    model = ws_package(
        tmp_path, fmt, BLOCK,
        variant_kernels=f"v.cubin:{KernelSpec(ws(), 'float16', D).name}",
        variant_launch_plans="b.plan.bin", variant_block_threads=[384],
        variant_blocks_per_tile_row=[1], variant_smem_bytes=[launch_numbers(ws(), D)[2]],
        variant_max_seq_len=[128], variant_max_batch_rows=[0])
    line = fake_error(fake, tmp_path, model)
    assert "attribute 'variant_launch_plans[0]': launch plan" in line and \
        "is for a block-wise kernel but 'variant_kernels[0]' names stofc_attn_ws_" in line, line
