"""Session-2 contracts of the custom-op library (cuda/ort/OPS.md), without a GPU.

B. Packed QKV: SparseAttention with both k and v omitted reads q as
   ``[B, S, 3*H*D] = [Q | K | V]``. CPU twin: bit-equal to the same node with separate
   q, k, v and close to the float64 numpy reference; one of k / v alone fails the run.
   CUDA twin (fake driver): k, v point H*D and 2*H*D elements into q, sequence stride
   3*H*D, out strides H*D = AttentionOp.bind on strided views of the packed tensor.
A. Run-time variants: the attribute parser (tests/attrs_test.cc) and, on the fake
   driver, the launch of the first eligible variant (else the base) for several (B, S),
   each equal to AttentionOp.bind for that variant's config; bad variant attributes fail
   session creation with one line naming attribute and index.
C. FusedGemm ``lt_algo_m`` / ``lt_algo_rank``: rank + 1 heuristic results requested,
   result ``rank`` (or the last returned) used for listed M, result 0 otherwise.
The CPU twins accept the CUDA-only attributes and compute the same result.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from stofc.kernels.attention import AttentionConfig, KernelSpec, smem_bytes
from stofc.kernels.attention.launch import launch_data
from stofc.lower.twins import KERNEL_ABI
from stofc.masks import encode
from stofc.package.maskbin import write_attention_plan, write_mask_binary
from tests.unit.test_ortlib import (  # noqa: F401
    F16,
    F32,
    NP,
    TOL,
    attention_ref,
    dense_to_format,
    lib,
    masks,
    run_node,
    vi,
)
from tests.unit.test_ortlib_abi import abi_table, cpu_runtime  # noqa: F401
from tests.unit.test_ortlib_cuda import ATTN_OK
from tests.unit.test_ortlib_fake_gpu import (
    attention_package,
    device_array,
    feeds_for,
    make_model,
    run,
)

VARIANT_ATTRS = dict(
    variant_kernels="k.cubin:stofc_attn_row_f16_x_b0_k0;k2.cubin:stofc_attn_block_f16_x_b0_k0",
    variant_launch_plans="missing.plan.bin;also_missing.plan.bin",
    variant_block_threads=[128, 256], variant_blocks_per_tile_row=[1, 2],
    variant_smem_bytes=[0, 4096], variant_max_seq_len=[64, 0], variant_max_batch_rows=[0, 8])


def attention_inputs(rng, B, S, H, D, elem, *, kpm: bool, bias: bool):
    dt = NP[elem]
    q, k, v = (rng.standard_normal((B, S, H * D)).astype(dt) for _ in range(3))
    key_mask = None
    if kpm:
        key_mask = np.ones((B, S), np.int64)
        key_mask[-1, S // 2:] = 0       # a padded sequence
        key_mask[0, 5] = 0              # a hole
    bias_arr = (rng.standard_normal((B, H, S, S)) * 2).astype(dt) if bias else None
    return q, k, v, key_mask, bias_arr


def attention_node(names, H, D, **extra):
    while names[-1] == "":
        names = names[:-1]
    return helper.make_node("SparseAttention", names, ["out0"], domain="ai.stofc", num_heads=H,
                            head_dim=D, mask_file="m.bin", **extra)


def run_packed_and_separate(lib, tmp_path, mask, *, tile, B, S, H, D, elem, kpm, bias,  # noqa: F811
                            seed=0, **extra):
    rng = np.random.default_rng(seed)
    write_mask_binary(dense_to_format(mask, tile), tmp_path / "m.bin")
    q, k, v, key_mask, bias_arr = attention_inputs(rng, B, S, H, D, elem, kpm=kpm, bias=bias)
    tail_names = ["kpm" if kpm else "", "bias" if bias else ""]
    tail_inputs, tail_feeds = [], {}
    if kpm:
        tail_inputs.append(vi("kpm", TensorProto.INT64, ["B", "S"]))
        tail_feeds["kpm"] = key_mask
    if bias:
        tail_inputs.append(vi("bias", elem, [B, H, "S", "S"]))
        tail_feeds["bias"] = bias_arr
    HD = H * D
    separate = attention_node(["q", "k", "v", *tail_names], H, D, **extra)
    (out_sep,) = run_node(lib, separate, [vi(n, elem, ["B", "S", HD]) for n in "qkv"] + tail_inputs,
                          {"q": q, "k": k, "v": v, **tail_feeds}, package_dir=tmp_path)
    qkv = np.concatenate([q, k, v], axis=-1)
    packed = attention_node(["qkv", "", "", *tail_names], H, D, **extra)
    (out_packed,) = run_node(lib, packed, [vi("qkv", elem, ["B", "S", 3 * HD]), *tail_inputs],
                             {"qkv": qkv, **tail_feeds}, package_dir=tmp_path)
    allowed = np.broadcast_to(mask, (H, *mask.shape[1:])) if mask.shape[0] == 1 else mask
    ref = attention_ref(q, k, v, allowed, key_mask, bias_arr, H, 1 / math.sqrt(D))
    return out_packed, out_sep, ref


@pytest.mark.parametrize("elem", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("kpm,bias", [(False, False), (True, False), (True, True)],
                         ids=["plain", "kpm", "kpm+bias"])
@pytest.mark.parametrize("name", ["random_per_head", "longformer"])
def test_packed_qkv_equals_separate_and_reference(lib, tmp_path, elem, kpm, bias, name):  # noqa: F811
    H, D, B, S, L = 3, 16, 2, 45, 64
    mask = masks(L, H, np.random.default_rng(11))[name]
    out_packed, out_sep, ref = run_packed_and_separate(lib, tmp_path, mask, tile=16, B=B, S=S, H=H,
                                                       D=D, elem=elem, kpm=kpm, bias=bias)
    assert out_packed.shape == out_sep.shape == (B, S, H * D)
    assert out_packed.dtype == NP[elem]
    # the same arithmetic in the same order: identical bits, not merely close
    assert np.array_equal(out_packed, out_sep)
    np.testing.assert_allclose(out_packed.astype(np.float64), ref, **TOL[elem])
    if kpm and not bias:
        assert np.isfinite(out_packed).all()


def test_packed_qkv_single_head_float16_full_length(lib, tmp_path):  # noqa: F811
    L = 128
    mask = masks(L, 1, np.random.default_rng(12))["causal"]
    out_packed, out_sep, ref = run_packed_and_separate(lib, tmp_path, mask, tile=64, B=1, S=L, H=1,
                                                       D=32, elem=F16, kpm=True, bias=False, seed=3)
    assert np.array_equal(out_packed, out_sep)
    np.testing.assert_allclose(out_packed.astype(np.float64), ref, **TOL[F16])


def _run_error(lib, tmp_path, node, inputs, feeds) -> str:  # noqa: F811
    with pytest.raises(Exception) as err:
        run_node(lib, node, inputs, feeds, package_dir=tmp_path)
    return str(err.value)


@pytest.mark.parametrize("names,given,missing", [(["q", "k"], "k", "v"), (["q", "k", ""], "k", "v"),
                                                  (["q", "", "v"], "v", "k")])
def test_one_of_k_v_omitted_fails_the_run(lib, tmp_path, names, given, missing):  # noqa: F811
    H, D, B, S = 2, 8, 1, 16
    write_mask_binary(dense_to_format(np.tril(np.ones((1, S, S), bool)), 16), tmp_path / "m.bin")
    rng = np.random.default_rng(0)
    node = attention_node(names, H, D)
    present = [n for n in names if n]
    msg = _run_error(lib, tmp_path, node, [vi(n, F32, [B, S, H * D]) for n in present],
                     {n: rng.standard_normal((B, S, H * D)).astype(np.float32) for n in present})
    assert f"stofc SparseAttention: input {missing} is omitted but {given} is given" in msg, msg
    assert "omit both to pass q packed as [B, S, (num_heads + 2*kv_num_heads)*head_dim]" in msg


def test_packed_q_of_the_wrong_width_fails_the_run(lib, tmp_path):  # noqa: F811
    H, D, B, S = 2, 8, 1, 16
    write_mask_binary(dense_to_format(np.tril(np.ones((1, S, S), bool)), 16), tmp_path / "m.bin")
    node = attention_node(["q", "", ""], H, D)
    msg = _run_error(lib, tmp_path, node, [vi("q", F32, [B, S, H * D])],
                     {"q": np.zeros((B, S, H * D), np.float32)})
    assert "input q has shape [1, 16, 16], expected [B, S, 48]" in msg, msg
    assert "k and v are omitted, so q is packed QKV" in msg


def test_cpu_twin_accepts_and_ignores_variant_attributes(lib, tmp_path):  # noqa: F811
    """The variants name files that do not exist: the CPU twin never reads them."""
    H, D, L = 2, 16, 64
    mask = masks(L, H, np.random.default_rng(13))["block_per_head"]
    plain = run_packed_and_separate(lib, tmp_path, mask, tile=32, B=2, S=50, H=H, D=D, elem=F32,
                                    kpm=True, bias=False)
    tuned = run_packed_and_separate(lib, tmp_path, mask, tile=32, B=2, S=50, H=H, D=D, elem=F32,
                                    kpm=True, bias=False, kernel="k.cubin:x", **VARIANT_ATTRS)
    for a, b in zip(plain[:2], tuned[:2], strict=True):
        assert np.array_equal(a, b)
    np.testing.assert_allclose(tuned[0], plain[2], **TOL[F32])


def test_cpu_fused_gemm_accepts_and_ignores_lt_algo_attributes(lib):  # noqa: F811
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    w = (rng.standard_normal((24, 12)) / 5).astype(np.float32)
    inputs, feeds = [vi("x", F32, [2, 5, 24]), vi("w", F32, [24, 12])], {"x": x, "w": w}
    outs = []
    for extra in ({}, {"lt_algo_m": [10, 64], "lt_algo_rank": [3, 1]}):
        node = helper.make_node("FusedGemm", ["x", "w"], ["out0"], domain="ai.stofc",
                                activation="gelu_erf", **extra)
        outs.append(run_node(lib, node, inputs, feeds)[0])
    assert np.array_equal(outs[0], outs[1])



# ---------------------------------------------------------------- attribute parsing (no ORT)

ROW_ENTRY = "stofc_attn_row_f16_d64_t64_w4_m2_s1_q1_o1_b0_k1"
BLOCK_ENTRY = "stofc_attn_block_f16_d64_t64_w2_m16_s2_q2_o1_b0_k1"
TWO_VARIANTS = {
    "variant_kernels": f"v0.cubin:{ROW_ENTRY};v1.cubin:{BLOCK_ENTRY}",
    "variant_launch_plans": "r.plan.bin;a.plan.bin",
    "variant_block_threads": [128, 64], "variant_blocks_per_tile_row": [32, 2],
    "variant_smem_bytes": [0, 30000], "variant_max_seq_len": [128, 0],
    "variant_max_batch_rows": [0, 4]}


def ask_variants(driver, attrs: dict, **run) -> str:
    fields = {k: v for k, v in {**ATTN_OK, **attrs, **run}.items() if v is not None}
    lines = ["|".join(["variants", *(f"{k}=l:{','.join(map(str, v))}" if isinstance(v, list)
                                     else f"{k}=i:{v}" if isinstance(v, int) else f"{k}=s:{v}"
                                     for k, v in fields.items())])]
    res = subprocess.run([str(driver)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True)
    (line,) = res.stdout.splitlines()
    return line


def test_variant_attributes_parse_in_order(driver):
    line = ask_variants(driver, TWO_VARIANTS)
    assert line == (
        f"OK n=2 ['variant_kernels[0]' file=v0.cubin entry={ROW_ENTRY} plan=r.plan.bin kind=row "
        "threads=128 per_row=32 smem=0 max_seq=128 max_rows=0] "
        f"['variant_kernels[1]' file=v1.cubin entry={BLOCK_ENTRY} plan=a.plan.bin kind=block "
        "threads=64 per_row=2 smem=30000 max_seq=0 max_rows=4]")
    assert ask_variants(driver, {}) == "OK n=0"                       # absent: no variants


@pytest.mark.parametrize("B,S,pick", [
    (1, 1, 0), (5, 128, 0),            # S <= 128: the first variant, whatever B
    (1, 129, 1), (2, 128 + 1, -1),     # B * ceil(S/64) = 3 <= 4, then 6 > 4: the base
    (1, 256, 1), (2, 256, -1), (4, 192, -1)])
def test_first_eligible_variant_is_selected(driver, B, S, pick):
    line = ask_variants(driver, TWO_VARIANTS, B=B, S=S, tile=64)
    assert line.endswith(f" pick={pick}"), line


BAD_VARIANTS = [
    ({"variant_block_threads": [128]},
     "attribute 'variant_block_threads' has 1 entries but 'variant_kernels' names 2 variants"),
    ({"variant_launch_plans": "r.plan.bin"},
     "attribute 'variant_launch_plans' has 1 entries but 'variant_kernels' names 2 variants"),
    ({"variant_kernels": None},
     "attribute 'variant_launch_plans' has 2 entries but 'variant_kernels' names 0 variants"),
    ({"variant_max_batch_rows": None},
     "attribute 'variant_max_batch_rows' has 0 entries but 'variant_kernels' names 2"),
    ({"variant_block_threads": [128, 48]},
     "attribute 'variant_block_threads[1]' = 48 is not a whole number of warps"),
    ({"variant_block_threads": [2048, 64]},
     "attribute 'variant_block_threads[0]' = 2048 is outside 1..1024"),
    ({"variant_blocks_per_tile_row": [32, 3]},
     "attribute 'variant_blocks_per_tile_row[1]' = 3 but a block-wise kernel splits"),
    ({"variant_smem_bytes": [0, 0]},
     "attribute 'variant_smem_bytes[1]' is required (> 0) for a block-wise"),
    ({"variant_max_seq_len": [-1, 0]}, "attribute 'variant_max_seq_len[0]' = -1 is negative"),
    ({"variant_max_batch_rows": [0, -2]}, "attribute 'variant_max_batch_rows[1]' = -2 is negative"),
    ({"variant_kernels": f"v0.cubin:{ROW_ENTRY};nocolon"},
     "attribute 'variant_kernels[1]' must be 'FILE.cubin:ENTRY'"),
    ({"variant_kernels": f"v0.cubin:my_kernel;v1.cubin:{BLOCK_ENTRY}"},
     "attribute 'variant_kernels[0]': attention kernel entry 'my_kernel' is not a stofc"),
    ({"variant_kernels": f"v0.cubin:{ROW_ENTRY[:-1]}0;v1.cubin:{BLOCK_ENTRY}"},
     "attribute 'variant_kernels[0]' names stofc_attn_row_f16_d64_t64_w4_m2_s1_q1_o1_b0_k0, "
     "compiled for other inputs or another dtype than 'kernel'"),
    ({"variant_kernels": f"v0.cubin:{ROW_ENTRY.replace('f16', 'bf16')};v1.cubin:{BLOCK_ENTRY}"},
     "compiled for other inputs or another dtype"),
    ({"variant_launch_plans": "r.plan.bin;"}, "attribute 'variant_launch_plans[1]' is empty"),
]


@pytest.mark.parametrize("change,message", BAD_VARIANTS, ids=[m[:40] for _, m in BAD_VARIANTS])
def test_bad_variant_attributes_fail_with_one_line_naming_them(driver, change, message):
    line = ask_variants(driver, {**TWO_VARIANTS, **change})
    assert line.startswith("ERR ") and message in line, line


@pytest.mark.parametrize("attrs,M,answer", [
    ({}, 7, "OK n=0 rank=0"),
    ({"lt_algo_m": [33, 7], "lt_algo_rank": [2, 11]}, 7, "OK n=2 rank=11"),
    ({"lt_algo_m": [33, 7], "lt_algo_rank": [2, 11]}, 33, "OK n=2 rank=2"),
    ({"lt_algo_m": [33, 7], "lt_algo_rank": [2, 11]}, 8, "OK n=2 rank=0"),
    ({"lt_algo_m": [33, 7], "lt_algo_rank": [2]},
     8, "ERR attributes 'lt_algo_m' (2 entries) and 'lt_algo_rank' (1 entries) must have one"),
    ({"lt_algo_m": [33]}, 8, "ERR attributes 'lt_algo_m' (1 entries) and 'lt_algo_rank' (0"),
    ({"lt_algo_m": [33, 0], "lt_algo_rank": [1, 1]}, 8, "ERR attribute 'lt_algo_m[1]' = 0 is not"),
    ({"lt_algo_m": [33, 33], "lt_algo_rank": [1, 2]}, 8,
     "ERR attribute 'lt_algo_m[1]' = 33 repeats lt_algo_m[0]"),
    ({"lt_algo_m": [33], "lt_algo_rank": [-1]}, 8,
     "ERR attribute 'lt_algo_rank[0]' = -1 is outside 0..255"),
])
def test_lt_algo_attributes(driver, attrs, M, answer):
    fields = [f"{k}=l:{','.join(map(str, v))}" for k, v in attrs.items()] + [f"M=i:{M}"]
    res = subprocess.run([str(driver)], input="|".join(["lt_algo", *fields]) + "\n",
                         capture_output=True, text=True, check=True)
    assert res.stdout.startswith(answer), res.stdout


# ---------------------------------------------------------------- CUDA twins on the fake driver

SPEC, L_MAX = "bigbird:block=16,window=3,global=1,random=1,seed=0", 256
BASE = AttentionConfig("block", 64, 16, 4, 2, 1)
FAKE_H, FAKE_D = 2, 64     # test_ortlib_fake_gpu's H, D
# (config, plan file, max_seq_len, max_batch_rows); v0 shares the base's plan file
VARIANTS = [
    (AttentionConfig("block", 64, 16, 2, 2, 2), "a.plan.bin", 64, 0),
    (AttentionConfig("row", 64, 2, 4), "r.plan.bin", 128, 0),
    (AttentionConfig("block", 64, 16, 4, 3, 1, gather=True), "g.plan.bin", 0, 4),
]


def per_row(config) -> int:
    return config.q_split if config.kind == "block" else config.tile // config.rows_per_block


def variant_package(pkg, *, kpm: bool, variants=VARIANTS, **override):
    """The fake-GPU test package of test_ortlib_fake_gpu plus run-time variants."""
    fmt = encode(SPEC, L_MAX)
    refs, plans = [], []
    for i, (config, plan, _, _) in enumerate(variants):
        write_attention_plan(launch_data(fmt, config), pkg / plan)
        (pkg / f"v{i}.cubin").write_bytes(b"fake variant cubin\0")
        refs.append(f"v{i}.cubin:{KernelSpec(config, 'float16', FAKE_D, has_key_bits=kpm).name}")
        plans.append(plan)
    attrs = dict(
        variant_kernels=";".join(refs), variant_launch_plans=";".join(plans),
        variant_block_threads=[c.threads for c, *_ in variants],
        variant_blocks_per_tile_row=[per_row(c) for c, *_ in variants],
        variant_smem_bytes=[smem_bytes(c, FAKE_D) if c.kind == "block" else 0
                            for c, *_ in variants],
        variant_max_seq_len=[v[2] for v in variants], variant_max_batch_rows=[v[3] for v in variants])
    attrs.update(override)
    return attention_package(pkg, SPEC, L_MAX, BASE, kpm=kpm, bias=False, **attrs)


def launches_per_run(records):
    runs = [i for i, r in enumerate(records) if r["call"] == "run"] + [len(records)]
    return [records[a:b] for a, b in itertools.pairwise(runs)]


def check_launch(records, attn, fmt, config, q, k, v, kpm):
    """``attn`` (a logged launch) is what AttentionOp(config).bind(q, k, v) launches."""
    import stofc.runtime.attention as rt
    from stofc.targets import get_profile

    op = rt.AttentionOp(fmt, config, "float16", FAKE_D, profile=get_profile("h100"))
    op._kernel = lambda has_bias, has_key_bits, has_softcap: (None,)
    kw = {"scale": 0.125, **({"key_mask": kpm} if kpm is not None else {})}
    want = op.bind(q, k, v, **kw)
    names = dict(abi_table())
    w = dict(zip(names, want.args, strict=True))
    a = attn["args"]
    assert attn["fn"] == KernelSpec(config, "float16", FAKE_D, has_key_bits=kpm is not None).name
    assert attn["grid"] == [want.grid, 1, 1] and attn["block"] == [want.block, 1, 1]
    assert attn["smem"] == (smem_bytes(config, FAKE_D) if config.kind == "block" else 0)
    for name, kind in names.items():
        if kind != "ptr":
            assert float(a[name]) == pytest.approx(float(w[name]), rel=1e-6), name
    for name, dtype in {"tile_row_ptr": np.int32, "tile_key": np.int32, "tile_part": np.int32,
                        "bitmaps": np.uint64, "gather_keys": np.int32, "q_perm": np.int32,
                        "row_order": np.int32}.items():
        expect = np.asarray(w[name]).ravel()
        assert np.array_equal(device_array(records, a[name], dtype, expect.size), expect), name
    assert a["kv_len_values"] == np.asarray(w["kv_len"]).tolist()
    if kpm is not None:
        assert [int(x) for x in a["key_bits_values"]] == np.asarray(w["key_bits"]).ravel().tolist()
    return a, w


# (B, S) -> the launch that must run: 0..2 = VARIANTS[i], None = the base
SELECTIONS = [((3, 64), 0),      # every variant is eligible: the first one
              ((1, 100), 1),     # S > 64: v0 out; v1 (S <= 128) before v2 (1 * 2 rows <= 4)
              ((2, 128), 1),     # boundary S == 128
              ((1, 200), 2),     # S > 128; 1 * 4 tile rows <= 4
              ((1, 256), 2),
              ((2, 129), None),  # 2 * 3 rows > 4: the base
              ((2, 256), None)]


def test_launch_uses_the_first_eligible_variant_else_the_base(fake, cpu_runtime, tmp_path):  # noqa: F811
    fmt, model = variant_package(tmp_path, kpm=True)
    rng = np.random.default_rng(0)
    feeds = [feeds_for(rng, B, S, True, False) for (B, S), _ in SELECTIONS]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    per_run = launches_per_run(records)
    assert len(per_run) == len(SELECTIONS)
    first = per_run[0]
    # the first run loads every launch's module (+ key_prep) and uploads each plan file once
    assert [r["call"] for r in first].count("module_load") == 1 + 1 + len(VARIANTS)
    assert [r["call"] for r in first].count("mem_alloc") == 3       # a, r, g (a shared)
    for recs in per_run[1:]:
        assert not [r for r in recs if r["call"] in ("mem_alloc", "htod", "module_load")]
    for ((B, S), pick), f, recs in zip(SELECTIONS, feeds, per_run, strict=True):
        config = BASE if pick is None else VARIANTS[pick][0]
        prep, attn = [r for r in recs if r["call"] == "launch"]
        assert prep["fn"] == "stofc_key_prep" and prep["grid"] == [B, 1, 1]
        split = {n: f[n].reshape(B, S, FAKE_H, FAKE_D) for n in "qkv"}
        check_launch(records, attn, fmt, config, split["q"], split["k"], split["v"], f["kpm"])


def test_packed_qkv_launch_points_into_q(fake, cpu_runtime, tmp_path):  # noqa: F811
    fmt, model = variant_package(tmp_path, kpm=True)
    node = model.graph.node[0]
    node.input[:] = ["qkv", "", "", "kpm"]
    HD = FAKE_H * FAKE_D
    del model.graph.input[:3]
    model.graph.input.insert(0, helper.make_tensor_value_info("qkv", F16, ["B", "S", 3 * HD]))
    rng = np.random.default_rng(1)
    shapes = [(1, 100), (2, 256)]                    # a variant (row-wise), then the base
    feeds = []
    for B, S in shapes:
        f = feeds_for(rng, B, S, True, False)
        feeds.append({"qkv": np.concatenate([f["q"], f["k"], f["v"]], axis=-1), "kpm": f["kpm"]})
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    for (B, S), f, recs, config in zip(shapes, feeds, launches_per_run(records),
                                       (VARIANTS[1][0], BASE), strict=True):
        (attn,) = [r for r in recs if r["call"] == "launch" and r["fn"] != "stofc_key_prep"]
        a = attn["args"]
        assert a["k"] - a["q"] == HD * 2 and a["v"] - a["q"] == 2 * HD * 2     # elements * 2 B
        for t in "qkv":
            assert (a[f"{t}_sb"], a[f"{t}_ss"], a[f"{t}_sh"]) == (S * 3 * HD, 3 * HD, FAKE_D)
        assert (a["o_sb"], a["o_ss"], a["o_sh"]) == (S * HD, HD, FAKE_D)
        assert a["o"] not in (a["q"], a["k"], a["v"])
        # = AttentionOp.bind on strided views of the packed tensor
        qkv = f["qkv"]
        views = [qkv[..., i * HD:(i + 1) * HD].reshape(B, S, FAKE_H, FAKE_D) for i in range(3)]
        assert not views[0].flags.c_contiguous
        _, w = check_launch(records, attn, fmt, config, *views, f["kpm"])
        ptr = lambda x: x.data.ptr  # noqa: E731
        assert ptr(w["k"]) - ptr(w["q"]) == a["k"] - a["q"]
        assert ptr(w["v"]) - ptr(w["q"]) == a["v"] - a["q"]


def fake_error(fake, tmp_path, model) -> str:
    """The whole session-creation error (the runner prints it JSON-encoded); one line."""
    import tests.unit.test_ortlib_fake_gpu as fake_gpu

    first_line = 'print("ERROR", str(err).strip().splitlines()[0])'
    assert first_line in fake_gpu.RUNNER
    runner = fake_gpu.RUNNER.replace(first_line, 'print("ERROR", json.dumps(str(err).strip()))')
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fake_gpu, "RUNNER", runner)
        code, out, records = run(fake, tmp_path, model, [])
    assert code == 3 and not [r for r in records if r["call"] == "run"], out
    (line,) = [x for x in out.splitlines() if x.startswith("ERROR ")]
    message = json.loads(line.removeprefix("ERROR "))
    assert "\n" not in message, message
    return message


FAKE_BAD = [
    ({"variant_smem_bytes": [1]}, "attribute 'variant_smem_bytes' has 1 entries but "
                                  "'variant_kernels' names 3 variants"),
    ({"variant_block_threads": [64, 128, 100]},
     "attribute 'variant_block_threads[2]' = 100 is not a whole number of warps"),
    ({"variant_launch_plans": "a.plan.bin;r.plan.bin;missing.plan.bin"},
     "attribute 'variant_launch_plans[2]': attention launch plan"),
    ({"variant_kernels": "v0.cubin:stofc_attn_block_f16_d64_t64_w2_m16_s2_q2_o1_b0_k0;"
                         "gone.cubin:stofc_attn_row_f16_d64_t64_w4_m2_s1_q1_o1_b0_k0;"
                         "v2.cubin:stofc_attn_block_f16_d64_t64_w4_m16_s3_q1_o1_b0_k0"},
     "attribute 'variant_kernels[1]': kernel file"),
    ({"variant_launch_plans": "a.plan.bin;causal.plan.bin;g.plan.bin"},
     "attribute 'variant_launch_plans[1]': launch plan"),
    ({"variant_launch_plans": "a.plan.bin;a.plan.bin;g.plan.bin"},
     "attribute 'variant_launch_plans[1]': launch plan"),
]


@pytest.mark.parametrize("override,message", FAKE_BAD, ids=[m[:40] for _, m in FAKE_BAD])
def test_bad_variants_fail_session_creation(fake, tmp_path, override, message):
    write_attention_plan(launch_data(encode("causal", L_MAX), VARIANTS[1][0]),
                         tmp_path / "causal.plan.bin")
    _, model = variant_package(tmp_path, kpm=False, **override)
    line = fake_error(fake, tmp_path, model)
    assert "stofc SparseAttention" in line and message in line, line
    if "causal" in str(override):
        assert "was not built for mask file" in line
    if override.get("variant_launch_plans") == "a.plan.bin;a.plan.bin;g.plan.bin":
        assert "is for a block-wise kernel but 'variant_kernels[1]' names" in line


# ---------------------------------------------------------------- FusedGemm: lt_algo_m / lt_algo_rank

GK, GN = 64, 128


def gemm_model(**attrs):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((GK, GN)).astype(np.float16), "w")
    node = helper.make_node("FusedGemm", ["x", "w"], ["y"], domain="ai.stofc", kernel_abi=KERNEL_ABI,
                            epilogue_kernel="", **attrs)
    return make_model(node, [helper.make_tensor_value_info("x", F16, ["M", GK])],
                      [helper.make_tensor_value_info("y", F16, ["M", GN])], [w])


def test_fused_gemm_uses_the_listed_heuristic_rank(fake, tmp_path):
    """The fake heuristic offers 5 results, result i = algorithm i + 1 with 4096 * (i + 1) bytes."""
    model = gemm_model(lt_algo_m=[33, 7, 12], lt_algo_rank=[2, 11, 0])
    Ms = [33, 33, 7, 12, 5, 7]
    code, out, records = run(fake, tmp_path, model,
                             [{"x": np.ones((M, GK), np.float16)} for M in Ms],
                             STOFC_FAKE_LT_RESULTS="5")
    assert code == 0, out
    # one heuristic call per M (the plan is cached per shape): rank + 1 results asked for
    heur = [(r["requested"], r["returned"]) for r in records if r["call"] == "lt_heuristic"]
    assert heur == [(3, 3), (12, 5), (1, 1), (1, 1)]
    assert len([r for r in records if r["call"] == "lt_desc"]) == 4
    mm = [r for r in records if r["call"] == "lt_matmul"]
    # result 2 for M=33; rank 11 for M=7 but only 5 returned: the last (4); result 0 otherwise
    want = {33: 3, 7: 5, 12: 1, 5: 1}
    assert [m["algo"] for m in mm] == [want[M] for M in Ms]
    assert [m["ws_size"] for m in mm] == [4096 * want[M] for M in Ms]
    layouts = [(r["rows"], r["cols"]) for r in records if r["call"] == "lt_layout"]
    assert layouts[1::3] == [(GK, M) for M in (33, 7, 12, 5)]     # x's layout per planned M


def test_fused_gemm_without_lt_algo_takes_result_zero(fake, tmp_path):
    code, out, records = run(fake, tmp_path, gemm_model(),
                             [{"x": np.ones((M, GK), np.float16)} for M in (33, 7)])
    assert code == 0, out
    assert [r["requested"] for r in records if r["call"] == "lt_heuristic"] == [1, 1]
    assert [m["algo"] for m in records if m["call"] == "lt_matmul"] == [1, 1]


def test_bad_lt_algo_fails_session_creation(fake, tmp_path):
    line = fake_error(fake, tmp_path, gemm_model(lt_algo_m=[33, 7], lt_algo_rank=[1, -3]))
    assert "stofc FusedGemm" in line and "attribute 'lt_algo_rank[1]' = -3 is outside 0..255" in line
