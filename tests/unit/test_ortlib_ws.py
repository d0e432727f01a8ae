"""The warp-specialised kernel's launch contract in the custom-op library, without a GPU.

``cuda/ort/attention_abi.h`` holds two more frozen tables, ``STOFC_ATTENTION_WS_ABI`` and
``STOFC_ATTENTION_WS_COMBINE_ABI``; they must equal the two entry points' signatures in
``templates/attention/block_ws.cu.j2``, the argument tuples ``WsLaunchData.bind`` builds
(run on the CPU with numpy standing in for CuPy) and the tables in OPS.md. A package's
kind-2 ``*.plan.bin`` holds the family's launch data, which ``WsLaunchData`` uploads too
(and which is :func:`plan_ws`'s walk); the C++ reader
(``launch_plan.cc``, through ``tests/attrs_test.cc``) must accept it, reject every damaged
index with one line, and derive the same grids, head strides, tensor-map shapes and
workspace sizes as ``WsLaunchData.bind``.
"""

from __future__ import annotations

import itertools
import re
import types
from dataclasses import replace

import numpy as np
import pytest

import stofc.runtime.attention as rt
import stofc.runtime.attention_ws as rws
from stofc.compile.batch import compile_kernels
from stofc.kernels.attention import AttentionConfig, smem_bytes
from stofc.kernels.attention.config import attention_family
from stofc.kernels.attention.family import AttentionProblem
from stofc.kernels.attention.launch import launch_data
from stofc.kernels.attention.reference import format_from_dense
from stofc.kernels.attention.residue import split_format
from stofc.kernels.attention.ws_launch import WsLaunchPlan
from stofc.kernels.attention.ws_plan import plan_ws
from stofc.kernels.render import render_kernel
from stofc.masks import encode
from stofc.package.layout import launch_plan_file
from stofc.package.maskbin import (
    PLAN_BIN_VERSION,
    PLAN_HEADER_BYTES,
    encode_attention_plan,
    read_attention_plan,
    write_attention_plan,
)
from stofc.runtime import tensor_map
from stofc.targets import get_profile
from tests.unit.test_ortlib_abi import FAKE_CUPY, OPS, _kind, _Recorder, abi_table, template_params
from tests.unit.test_ortlib_cuda import ask

H100 = get_profile("h100")
WS_ABI, COMBINE_ABI = "STOFC_ATTENTION_WS_ABI", "STOFC_ATTENTION_WS_COMBINE_ABI"
TEMPLATE = "block_ws.cu.j2"


def ws(split=0, stages=2, kstep=1, pingpong=True, consumers=2, period=1) -> AttentionConfig:
    return AttentionConfig("ws", 64, 16, 4 * (consumers + 1), stages, 1, mma="wgmma",
                           split=split, pingpong=pingpong, kstep=kstep, period=period)


def launch_numbers(config: AttentionConfig, head_dim: int) -> tuple[int, int, int]:
    """SparseAttention's (block_threads, blocks_per_tile_row, smem_bytes) for ``config``."""
    launch = dict(attention_family(config.kind).launch(config, head_dim))
    return launch["block_threads"], launch["blocks_per_tile_row"], launch["smem_bytes"]


def per_head_format(L: int, heads: int = 2):
    """A per-head mask: causal for head 0, a random 10% for head 1 (with global rows)."""
    rng = np.random.default_rng(0)
    dense = np.stack([np.tril(np.ones((L, L), bool)), rng.random((L, L)) < 0.1])[:heads]
    dense[1, :16] = True                                     # long rows: split them
    return format_from_dense(dense, 64)


# ---------------------------------------------------------------- the frozen tables


def test_ws_tables_match_the_template_signatures():
    main, combine = abi_table(WS_ABI), abi_table(COMBINE_ABI)
    assert len(main) == 31 and len(combine) == 12
    assert template_params(TEMPLATE) == main                 # names and types, in order
    assert template_params(TEMPLATE, "{{ kernel_name }}_combine") == combine
    assert [n for n, t in main if t == "map"] == ["tma_q", "tma_k", "tma_v"]


def test_ws_tables_are_documented_in_ops_md():
    text = OPS.read_text()
    for title, macro in (("### The warp-specialised kernel's argument list", WS_ABI),
                         ("### The combine kernel's argument list", COMBINE_ABI)):
        section = text[text.index(title):]
        section = section[:section.index("\n### ", 4)]
        rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (ptr|i64|i32|f32|map) \|", section, re.M)
        assert [(n, t) for _, n, t in rows] == abi_table(macro), title
        assert [int(i) for i, _, _ in rows] == list(range(len(rows)))


PTX_PARAM = {"ptr": ".u64", "i64": ".u64", "i32": ".u32", "f32": ".f32",
             "map": ".align 64 .b8 [128]"}


def test_compiled_entry_points_take_the_tables_types():
    """What the driver copies per kernel parameter (the PTX .param list NVRTC emits for
    sm_90a) is what each table row's type packs: 8-byte pointers and i64, 4-byte i32 and
    f32, and the tensor maps as 128 bytes aligned to 64."""
    from stofc.kernels.attention import KernelSpec, compile_kernel

    spec = KernelSpec(ws(split=8), "bfloat16", 128, True, True, has_softcap=True)
    ptx = compile_kernel(spec, "compute_90").binary.decode()
    for entry, macro in ((spec.name, WS_ABI), (f"{spec.name}_combine", COMBINE_ABI)):
        params = re.search(rf"\.entry {entry}\((.*?)\)", ptx, re.S).group(1)
        got = [re.sub(rf"\s+{entry}_param_\d+", " ", p.strip().removeprefix(".param ")).strip()
               for p in params.split(",")]
        assert got == [PTX_PARAM[t] for _, t in abi_table(macro)], entry


@pytest.fixture
def ws_runtime(monkeypatch):
    """AttentionOp / WsLaunchData on the CPU: numpy for CuPy, launches recorded, tensor maps
    replaced by the encode arguments (``maps`` collects them)."""
    fake = types.SimpleNamespace(**vars(FAKE_CUPY), float32=np.float32)
    monkeypatch.setattr(rt, "_cupy", lambda: fake)
    monkeypatch.setattr(rt, "device_arch", lambda: "sm_90")
    monkeypatch.setattr("stofc.runtime.launches.BoundLaunch", _Recorder)
    monkeypatch.setattr(rws, "BoundLaunch", _Recorder)
    maps: list[tuple] = []

    def get(self, address, dtype, dims, strides, box, steps=None):
        maps.append((address, dtype, dims, strides, box, steps or (1,) * len(dims)))
        return tensor_map.TensorMap(len(maps).to_bytes(1, "little") * 128)

    monkeypatch.setattr(tensor_map.TensorMapCache, "get", get)
    return maps


def ws_op(fmt, config, head_dim=64, dtype="float16", sm_count=H100.sm_count):
    op = rt.AttentionOp(fmt, config, dtype, head_dim, profile=replace(H100, sm_count=sm_count))
    # the loaded kernels of one variant: the main one (named by its flags), the combine
    op._kernel = lambda has_bias, has_key_bits, has_softcap: (
        ("main", has_bias, has_key_bits, has_softcap), "combine")
    return op


def test_ws_launch_arguments_match_the_tables(ws_runtime):
    fmt = encode("longformer:window=64,global=16", 1024)
    op = ws_op(fmt, ws(split=8))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 900, 2, 64)).astype(np.float16) for _ in range(3))
    launch = op.bind(q, k, v, key_mask=np.ones((2, 900), np.int64))
    kinds = ["map" if isinstance(a, tensor_map.TensorMap) else _kind(a) for a in launch.args]
    assert kinds == [t for _, t in abi_table(WS_ABI)]
    assert launch.then is not None                            # the plan splits rows
    assert [_kind(a) for a in launch.then.args] == [t for _, t in abi_table(COMBINE_ABI)]
    assert launch.block == 384 and launch.then.block == 256 and launch.kernel[0] == "main"
    assert launch.then.kernel == "combine"


# ---------------------------------------------------------------- the kind-2 plan file

PLANS = [("causal", 1000, 0), ("longformer:window=128,global=32", 2048, 8),
         ("bigbird:block=64,window=3,global=2,random=3,seed=0", 1500, 16),
         ("sliding:window=64", 700, 0), ("dense", 130, 8)]


def _uploaded(op) -> dict[str, np.ndarray]:
    d = op._launch.ws
    return {"entry_key": d._keys, "entry_part": d._parts, "bitmaps": d._bitmaps,
            "items": d._items, "orders": d._orders, "combine": d._combine}


@pytest.mark.parametrize("spec,L,split", PLANS)
def test_plan_file_holds_what_ws_launch_data_uploads(ws_runtime, tmp_path, spec, L, split):
    fmt = encode(spec, L)
    config = ws(split=split)
    data = launch_data(fmt, config)
    assert isinstance(data, WsLaunchPlan)
    back = read_attention_plan(write_attention_plan(data, tmp_path / "w.plan.bin"))
    op = ws_op(fmt, config)
    for name, arr in _uploaded(op).items():
        assert np.array_equal(getattr(back, name), np.asarray(arr)), name
        assert getattr(back, name).dtype == np.asarray(arr).dtype, name
    plan = plan_ws(fmt, split_tiles=split)
    assert np.array_equal(back.order_ptr, plan.order_ptr)
    assert np.array_equal(back.items_upto, plan.items_upto)
    assert (back.pairs, back.slots, back.split, back.num_heads) == (plan.pairs, plan.slots, split, 1)
    assert back.splits == bool((plan.combine[:, :, 0] >= 0).any())
    assert (back.items_head_stride, back.order_head_stride, back.combine_head_stride) == (0, 0, 0)
    for seq in (1, 127, 128, 129, L):
        assert back.launch_items(seq) == plan.launch_items(seq)
    assert (back.tile, back.tile_rows, back.seq_len, back.spec_hash) == \
        (64, fmt.tile_rows, L, fmt.spec_hash[:32])


def test_per_head_plan_and_its_strides(ws_runtime, tmp_path):
    fmt = per_head_format(700)
    data = launch_data(fmt, ws(split=8))
    back = read_attention_plan(write_attention_plan(data, tmp_path / "w.plan.bin"))
    op = ws_op(fmt, ws(split=8))
    plan = plan_ws(fmt, split_tiles=8)
    assert back.num_heads == 2 and back.splits
    assert back.items_head_stride == plan.items.shape[1] * 5 == back.n_items * 5 > 0
    assert back.order_head_stride == plan.orders.shape[1] > 0
    assert back.combine_head_stride == plan.combine.shape[1] * 3 == back.n_split * 3
    for name, arr in _uploaded(op).items():
        assert np.array_equal(getattr(back, name), np.asarray(arr)), name


def test_plan_header_and_names():
    fmt = encode("causal", 256)
    blob = encode_attention_plan(launch_data(fmt, ws()))
    assert blob[:8] == b"STOFAPLN" and int.from_bytes(blob[8:12], "little") == PLAN_BIN_VERSION == 7
    assert int.from_bytes(blob[12:16], "little") == PLAN_HEADER_BYTES == 256
    assert int.from_bytes(blob[16:20], "little") == 2                      # kind ws
    assert int.from_bytes(blob[36:40], "little") == 8                      # arrays
    assert len(blob) % 8 == 0
    mid = f"mask-{fmt.spec_hash[:16]}"

    def name(config):
        return launch_plan_file(fmt, attention_family(config.kind).launch_key(config))

    assert name(ws()) == f"masks/{mid}.ws.plan.bin"
    assert name(ws(split=16, stages=3)) == f"masks/{mid}.ws-split16.plan.bin"
    assert name(AttentionConfig("block", 64, 16, 4, 2, 1, gather=True)) == \
        f"masks/{mid}.block-gather.plan.bin"
    # ws: 384 threads, its dynamic shared memory, 1 for blocks_per_tile_row (unused)
    assert launch_numbers(ws(stages=3), 128) == (384, 1, smem_bytes(ws(stages=3), 128))
    assert launch_numbers(AttentionConfig("row", 64, 2, 4), 64) == (128, 8, 0)


def test_cpp_reader_accepts_ws_plans(driver, tmp_path):
    for i, (fmt, split, period) in enumerate([
            (encode("longformer:window=128,global=32", 2048), 8, 1), (per_head_format(700), 8, 1),
            (encode("causal", 1000), 0, 1), (encode("dilated:window=256,dilation=2", 1999), 8, 2)]):
        data = launch_data(fmt, ws(split=split, period=period))
        path = write_attention_plan(data, tmp_path / f"{i}.plan.bin")
        (line,) = ask(driver, ("plan", {"path": str(path)}))
        assert line == (f"OK kind=ws tile=64 rows={fmt.tile_rows} heads={data.num_heads} "
                        f"pairs={data.pairs} slots={data.slots} items={data.n_items} "
                        f"split={split} splits={int(data.splits)} "
                        f"entries={data.entry_key.size - 1}"), line


def _damaged(data: WsLaunchPlan, **arrays) -> bytes:
    return encode_attention_plan(replace(data, **arrays))


def test_cpp_reader_rejects_every_bad_index(driver, tmp_path):
    fmt = encode("longformer:window=128,global=32", 2048)
    d = launch_data(fmt, ws(split=8))
    assert isinstance(d, WsLaunchPlan) and d.splits

    def edit(name, index, value):
        arr = getattr(d, name).copy()
        arr[index] = value
        return {name: arr}

    real_item = int(np.nonzero(d.items.reshape(-1, 5)[:, 0] >= 0)[0][0])
    shared_item = int(np.nonzero(d.items.reshape(-1, 5)[:, 4] > 0)[0][0])
    split_row = int(np.nonzero(d.combine.reshape(-1, 3)[:, 0] >= 0)[0][0])
    cases = {
        "entry key out of range": edit("entry_key", 0, fmt.tile_rows * 64),
        "entry key out of range ": edit("entry_key", 1, 65),                  # not a tile start
        "entry part out of range": edit("entry_part", 3, -3),
        "entry part out of range  ": edit("entry_part", 0, d.bitmaps.size // 64),
        "item range outside the walk": edit("items", 5 * real_item + 2, d.entry_key.size),
        "item pair row out of range": edit("items", 5 * real_item, d.pairs),
        "item slot out of range": edit("items", 5 * real_item + 3, d.slots),
        "item shared out of range": edit("items", 5 * real_item + 4, 1 + d.consumers),
        "item shared out of range ": edit("items", 5 * shared_item + 3, -1),      # not a chunk
        "order entry out of range": edit("orders", 0, d.n_items),
        "combine row out of range": edit("combine", 3 * split_row + 2, 65),    # > 64 chunks
        "combine row out of range ": edit("combine", 3 * split_row + 1, d.slots),
        "order_ptr / items_upto are inconsistent": edit("items_upto", 1, d.items_upto[1] + 1),
        "bad number of pair rows": {"pairs": d.pairs + 1},
        "a residue split has period 1, 2 or 4": {"period": 3},
        "bad number of pair rows ": {"period": 2},       # the walk is not the split mask's
    }
    paths = []
    for i, (_, change) in enumerate(cases.items()):
        paths.append(tmp_path / f"bad{i}.plan.bin")
        paths[-1].write_bytes(_damaged(d, **change))
    lines = ask(driver, *(("plan", {"path": str(p)}) for p in paths))
    for (message, _), line in zip(cases.items(), lines, strict=True):
        assert line.startswith("ERR ") and message.strip() in line and "is corrupt" in line, \
            (message, line)
        assert "\n" not in line


def test_cpp_reader_refuses_an_old_layout(driver, tmp_path):
    blob = bytearray(encode_attention_plan(launch_data(encode("causal", 256), ws())))
    blob[8:12] = (1).to_bytes(4, "little")
    (tmp_path / "old.plan.bin").write_bytes(bytes(blob))
    (line,) = ask(driver, ("plan", {"path": str(tmp_path / "old.plan.bin")}))
    assert "has layout version 1, this library reads 7" in line, line


# ---------------------------------------------------------------- launch scalars = bind


def _views(B, S, H, Hkv, D, packed, rng):
    """q, k, v as [B, S, heads, D] views: separate tensors, or strided views of one packed
    [B, S, (H + 2 Hkv) D] tensor."""
    if packed:
        qkv = rng.standard_normal((B, S, (H + 2 * Hkv) * D)).astype(np.float16)
        q = qkv[..., :H * D].reshape(B, S, H, D)
        k = qkv[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D)
        v = qkv[..., (H + Hkv) * D:].reshape(B, S, Hkv, D)
        return q, k, v
    return (rng.standard_normal((B, S, h, D)).astype(np.float16) for h in (H, Hkv, Hkv))


SCALAR_CASES = [  # (fmt, split, B, S, H, Hkv, D, packed, SMs, consumers, period)
    ("longformer:window=128,global=32", 8, 2, 2000, 4, 4, 64, False, 132, 2, 1),   # 132 SMs
    ("longformer:window=128,global=32", 8, 3, 200, 4, 2, 128, True, 132, 2, 1),    # GQA, packed
    ("causal", 0, 1, 1000, 2, 1, 64, False, 7, 2, 1),                              # MQA, 7 SMs
    ("per-head", 8, 2, 650, 2, 2, 128, True, 114, 2, 1),
    ("longformer:window=128,global=32", 8, 2, 2000, 4, 2, 64, True, 132, 3, 1),    # 192-row blocks
    ("per-head", 8, 2, 650, 2, 2, 64, False, 114, 3, 1),
    ("dilated:window=256,dilation=2", 8, 2, 1999, 4, 2, 64, True, 132, 2, 2),      # residue split
    ("dilated:window=256,dilation=4", 0, 1, 1003, 2, 2, 128, False, 132, 3, 4),
]


@pytest.mark.parametrize("spec,split,B,S,H,Hkv,D,packed,sms,consumers,period", SCALAR_CASES)
def test_cpp_ws_scalars_equal_ws_launch_data_bind(driver, ws_runtime, tmp_path, spec, split,
                                                  B, S, H, Hkv, D, packed, sms, consumers,
                                                  period):
    fmt = per_head_format(700) if spec == "per-head" else encode(spec, 2048 if split else 1000)
    if period > 1:
        fmt = encode(spec, 2048)
    config = ws(split=split, consumers=consumers, period=period)
    path = write_attention_plan(launch_data(fmt, config), tmp_path / "w.plan.bin")
    op = ws_op(fmt, config, head_dim=D, sm_count=sms)
    rng = np.random.default_rng(2)
    q, k, v = _views(B, S, H, Hkv, D, packed, rng)
    launch = op.bind(q, k, v, scale=0.125, key_mask=np.ones((B, S), np.int64))
    want = dict(zip([n for n, _ in abi_table(WS_ABI)], launch.args, strict=True))
    (line,) = ask(driver, ("pack", {"path": str(path), "B": B, "S": S, "H": H, "Hkv": Hkv, "D": D,
                                    "kpm": 1, "per_row": 1, "scale_milli": 125,
                                    "packed": int(packed), "sm": sms}))
    got = dict(item.split("=") for item in line.removeprefix("OK ").split())
    # the persistent grid: at most one block per SM over n_work = H * B * items works
    assert int(got["grid"]) == launch.grid == min(int(want["n_work"]), sms)
    assert int(want["n_work"]) == H * B * period * int(got["items"])
    for name in ("items_head_stride", "order_head_stride", "slots", "key_words", "kv_group",
                 "n_work"):
        assert int(got[name]) == int(want[name]), name
    for name in ("o_sb", "o_ss", "o_sh"):
        assert int(got[name]) == int(want[name]), name
    walked = split_format(fmt, period)
    offset, count = plan_ws(walked, split_tiles=split, consumers=consumers).launch_items(
        -(-S // period))
    assert (int(got["order_offset"]), int(got["items"])) == (offset, count)
    assert int(got["threads"]) == launch.block == 128 * (consumers + 1)
    # the tensor maps WsLaunchData encodes: q, k, v in that order
    maps = ws_runtime[-3:]
    for (address, dtype, dims, strides, box, steps), t, view in zip(maps, "qkv", (q, k, v),
                                                                    strict=True):
        assert got[f"{t}_dims"] == ",".join(map(str, dims)), t
        assert got[f"{t}_strides"] == ",".join(map(str, strides)), t
        assert got[f"{t}_box"] == ",".join(map(str, box)) == f"64,1,{64 * period},1"
        assert got[f"{t}_steps"] == ",".join(map(str, steps)) == f"1,1,{period},1"
        assert address == view.__array_interface__["data"][0] and dtype == "float16"
        offset_elems = (address - q.__array_interface__["data"][0]) // 2 if packed else 0
        assert int(got[f"{t}_offset"]) == offset_elems, t
    if launch.then is None:
        assert int(got["combine_grid"]) == 0 and int(got["part_o_bytes"]) == 0
    else:
        cw = dict(zip([n for n, _ in abi_table(COMBINE_ABI)], launch.then.args, strict=True))
        assert int(got["combine_grid"]) == launch.then.grid
        assert int(got["combine_head_stride"]) == int(cw["combine_head_stride"])
        assert int(got["part_o_bytes"]) == np.asarray(want["part_o"]).nbytes
        assert int(got["part_ml_bytes"]) == np.asarray(want["part_ml"]).nbytes


def test_ws_plan_matches_plan_ws_directly():
    """The package's plan is plan_ws's own walk (no copy drift)."""
    fmt = encode("bigbird:block=64,window=3,global=2,random=3,seed=0", 1500)
    plan, data = plan_ws(fmt, split_tiles=16), launch_data(fmt, ws(split=16))
    assert np.array_equal(data.entry_key, plan.entry_key)
    assert np.array_equal(data.items.reshape(plan.items.shape), plan.items)


# ---------------------------------------------------------------- the package's NVRTC builds


def _every_ws_variant() -> list:
    """One KernelSpec per distinct ws source shape of the search space (stages, pingpong,
    kstep, consumer warpgroups, head_dim: ``split`` changes the plan only), the dtype and the bias / key-bits /
    soft-capping flags cycling so that each of their 16 combinations is compiled too."""
    from stofc.kernels.attention import KernelSpec, search_space

    shapes = sorted({(d, c.stages, c.pingpong, c.kstep, c.warps // 4 - 1) for d in (64, 128, 256)
                     for c in search_space("ws", d, "float16", H100)})
    flags = itertools.cycle(itertools.product(("float16", "bfloat16"), (False, True),
                                              (False, True), (False, True)))
    return [KernelSpec(ws(stages=s, pingpong=pp, kstep=k, consumers=n), dt, d, b, kb,
                       has_softcap=c)
            for (d, s, pp, k, n), (dt, b, kb, c) in zip(shapes, flags, strict=False)]


@pytest.mark.slow
def test_package_compiles_every_ws_variant_for_sm_90a():
    """What a package ships for an H100 (targets sm_90 + compute_90): every ws source shape
    builds with NVRTC for the arch-specific sm_90a / compute_90a (setmaxnreg, wgmma and the
    TMA need it), both entry points in the cubin and the PTX."""
    specs = _every_ws_variant()
    # 22 two-consumer shapes (head_dims 64/128/256), 14 three-consumer ones (head_dim 64,
    # and 128 with Q in shared memory), 8 four-consumer ones (head_dim 64) and 2 one-consumer
    # ones (head_dim 64, rings of two and three: three blocks an SM); the six-stage ring only
    # at head_dim 64 (pruned elsewhere by shared memory)
    assert len(specs) == 46 and len({(s.dtype, s.has_bias, s.has_key_bits, s.has_softcap)
                                     for s in specs}) == 16
    family, fmt, targets = attention_family("ws"), encode("causal", 256), ("sm_90", "compute_90")
    rendered = [render_kernel(family.kernels(AttentionProblem(
        fmt, 1, 1, s.head_dim, 256, s.dtype, has_bias=s.has_bias, has_key_bits=s.has_key_bits,
        has_softcap=s.has_softcap), s.config)[0], targets) for s in specs]
    assert {r.nvrtc_target(t) for r in rendered for t in targets} == {"sm_90a", "compute_90a"}
    compiled = compile_kernels(rendered, targets)
    for src in (r.source for r in rendered):
        cubin, ptx = compiled[(src.name, "sm_90")], compiled[(src.name, "compute_90")]
        assert (cubin.target, ptx.target) == ("sm_90a", "compute_90a")
        for entry in src.entry_points:
            assert entry.encode() in cubin.binary and f".entry {entry}(".encode() in ptx.binary
        assert b".target sm_90a" in ptx.binary
