"""The CUDA twins without a GPU: registration table, attribute checks, launch-plan reader.

``cuda/ort/tests/attrs_test.cc`` is built with g++ together with the library's own
``cuda_attrs.cc`` and ``launch_plan.cc`` (the code the CUDA twins run at session
creation); it links neither ONNX Runtime nor CUDA. Every defect must be a one-line
AttrError naming the attribute, which the twins turn into a session-creation error.
The Python side of the FusedGemm / AddLayerNorm split (``stofc.lower.twins``)
must equal the C++ side for every input combination.
"""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stofc.kernels.attention import AttentionConfig
from stofc.kernels.attention.launch import launch_data
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.vendor_gemm import split_fused_gemm
from stofc.lower.twins import KERNEL_ABI, norm_epilogue
from stofc.masks import encode
from stofc.package.maskbin import PLAN_HEADER_BYTES, encode_attention_plan
from stofc.package.ortlib import sources_dir

ENTRY = "stofc_attn_block_f16_d64_t64_w4_m16_s2_q1_o1_b0_k1"
ATTN_OK = {"kernel_abi": 4, "kernel": f"kernels/a.sm_90.cubin:{ENTRY}",
           "launch_plan": "masks/m.block.plan.bin", "block_threads": 128,
           "blocks_per_tile_row": 1, "smem_bytes": 55296}


def ask(driver: Path, *cases: tuple[str, dict]) -> list[str]:
    lines = []
    for parser, attrs in cases:
        fields = [f"{k}=i:{v}" if isinstance(v, int) else f"{k}=s:{v}" for k, v in attrs.items()]
        lines.append("|".join([parser, *fields]))
    res = subprocess.run([str(driver)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True)
    out = res.stdout.splitlines()
    assert len(out) == len(cases)
    return out


def test_cuda_twins_registered_for_float16_and_bfloat16(driver):
    res = subprocess.run([str(driver), "registrations"], capture_output=True, text=True, check=True)
    lines = res.stdout.splitlines()
    assert lines[-1] == f"abi {KERNEL_ABI}"
    regs = {tuple(line.split()) for line in lines[:-1]}
    assert len(regs) == len(lines) - 1 == 36
    ops = ("SparseAttention", "FusedGemm", "AddLayerNorm", "GatedGemm", "EmbedLayerNorm")
    f32, f16, bf16, u8 = "1", "10", "16", "2"   # ONNX TensorProto element types
    eps = ("CUDAExecutionProvider", "CPUExecutionProvider")
    # bf16 packages' float pre-LN forms (OPS.md): FusedGemm bias (input 2) float -> y float;
    # AddLayerNorm x (input 0) any, gamma and beta (inputs 2, 3) float
    mixed = {("FusedGemm", ep, bf16, "float_inputs=4", "float_outputs=1") for ep in eps} | \
            {("AddLayerNorm", ep, bf16, "float_inputs=12", "any_inputs=1") for ep in eps}
    # Rotary: cos and sin (inputs 3, 4) float
    rotary = {("Rotary", "CUDAExecutionProvider", t, "float_inputs=24") for t in (f16, bf16)} | \
             {("Rotary", "CPUExecutionProvider", t, "float_inputs=24") for t in (f32, f16, bf16)}
    assert regs == {(op, "CUDAExecutionProvider", t) for op in ops for t in (f16, bf16)} | \
                  {(op, "CPUExecutionProvider", t) for op in ops for t in (f32, f16, bf16)} | \
                  mixed | {("KeyPrep", ep, u8) for ep in eps} | rotary


def test_valid_attention_attributes_parse(driver):
    (line,) = ask(driver, ("attention", ATTN_OK))
    assert line == (f"OK file=kernels/a.sm_90.cubin entry={ENTRY} plan=masks/m.block.plan.bin "
                    "kind=block bf16=0 bias=0 keybits=1 threads=128 per_row=1 smem=55296")
    row = dict(ATTN_OK, kernel="k.cubin:stofc_attn_row_bf16_d64_t64_w4_m2_s1_q1_o1_b1_k0",
               blocks_per_tile_row=8, smem_bytes=0)
    (line,) = ask(driver, ("attention", row))
    assert "kind=row bf16=1 bias=1 keybits=0" in line and "per_row=8" in line


BAD_ATTENTION = [
    ({"kernel_abi": None}, "carries no CUDA launch attributes (kernel_abi 4)"),
    ({"kernel_abi": 1}, "kernel_abi=1 but this library launches kernel_abi 4"),
    ({"kernel": None}, "attribute 'kernel' (FILE.cubin:ENTRY) is required"),
    ({"kernel": "nocolon.cubin"}, "attribute 'kernel' must be 'FILE.cubin:ENTRY'"),
    ({"kernel": "a.cubin:my_kernel"}, "is not a stofc attention kernel"),
    ({"launch_plan": None}, "attribute 'launch_plan'"),
    ({"block_threads": None}, "attribute 'block_threads' is required"),
    ({"block_threads": 2048}, "attribute 'block_threads' = 2048 is outside 1..1024"),
    ({"block_threads": 100}, "not a whole number of warps"),
    ({"blocks_per_tile_row": 0}, "attribute 'blocks_per_tile_row' = 0 is outside"),
    ({"blocks_per_tile_row": 4}, "splits a tile row in 1 or 2"),
    ({"smem_bytes": 0}, "attribute 'smem_bytes' is required (> 0) for a block-wise"),
    ({"smem_bytes": -1}, "attribute 'smem_bytes' = -1 is outside"),
]


@pytest.mark.parametrize("change,message", BAD_ATTENTION, ids=[m[:30] for _, m in BAD_ATTENTION])
def test_invalid_attention_attributes_fail_with_one_clear_line(driver, change, message):
    attrs = {k: v for k, v in {**ATTN_OK, **change}.items() if v is not None}
    (line,) = ask(driver, ("attention", attrs))
    assert line.startswith("ERR ") and message in line, line


NORM_ENTRY = "stofc_add_norm_bfloat16_r_ln_s_n768_t32x4"
EPI_OK = {"kernel_abi": 4, "epilogue_kernel": f"kernels/n.sm_90.cubin:{NORM_ENTRY}",
          "epilogue": "r-ln-s", "epilogue_threads": 128, "epilogue_rows": 1}


def test_epilogue_attributes(driver):
    ok, none, bad_tag, odd_tag, missing, warps, no_abi, not_norm = ask(
        driver, ("epilogue:AddLayerNorm", EPI_OK),
        ("epilogue:FusedGemm", {"kernel_abi": 4, "epilogue_kernel": ""}),
        ("epilogue:AddLayerNorm", dict(EPI_OK, epilogue="r-layernorm")),
        ("epilogue:AddLayerNorm", dict(EPI_OK, epilogue="ln-r")),
        ("epilogue:FusedGemm", {"kernel_abi": 4}),
        ("epilogue:AddLayerNorm", dict(EPI_OK, epilogue_threads=96, epilogue_rows=2)),
        ("epilogue:FusedGemm", {"epilogue_kernel": ""}),
        ("epilogue:AddLayerNorm", dict(EPI_OK, epilogue_kernel="k.cubin:stofc_attn_block_x")))
    assert ok == (f"OK present=1 bf16=1 file=kernels/n.sm_90.cubin entry={NORM_ENTRY} tag=r-ln-s "
                  "threads=128 rows=1")
    assert none == "OK present=0"
    assert bad_tag.startswith("ERR ") and "unknown part 'layernorm'" in bad_tag
    assert odd_tag.startswith("ERR ") and "not a canonical epilogue tag (expected 'r-ln')" in odd_tag
    assert missing.startswith("ERR ") and "attribute 'epilogue_kernel'" in missing
    assert warps.startswith("ERR ") and "whole warps" in warps
    assert no_abi.startswith("ERR ") and "FusedGemm node carries no CUDA launch attributes" in no_abi
    assert not_norm.startswith("ERR ") and "not a stofc Add+Norm kernel" in not_norm


GLU_ENTRY = "stofc_glu_float16_silu_f11008_t256x1"
GLU_OK = {"kernel_abi": 4, "epilogue_kernel": f"kernels/g.sm_90.cubin:{GLU_ENTRY}",
          "epilogue_threads": 256, "epilogue_rows": 1}


def test_gated_gemm_attributes(driver):
    """GatedGemm's gated-activation kernel: its entry name must name the node's activation
    and no bias (cuBLASLt adds it); the row width F is read from it."""
    out = ask(driver, ("glu:silu", GLU_OK),
              ("glu:gelu_erf", GLU_OK),
              ("glu:silu", dict(GLU_OK, epilogue_kernel="g.cubin:stofc_glu_float16_silu_b_f64_t32x4")),
              ("glu:silu", dict(GLU_OK, epilogue_kernel=f"g.cubin:{NORM_ENTRY}")),
              ("glu:silu", dict(GLU_OK, epilogue_kernel="")),
              ("glu:silu", dict(GLU_OK, epilogue_kernel="g.cubin:stofc_glu_float16_silu_t32x4")),
              ("glu:silu", dict(GLU_OK, epilogue_threads=96, epilogue_rows=2)),
              ("glu:silu", {k: v for k, v in GLU_OK.items() if k != "kernel_abi"}))
    ok, other_act, with_bias, not_glu, empty, no_width, warps, no_abi = out
    assert ok == (f"OK bf16=0 file=kernels/g.sm_90.cubin entry={GLU_ENTRY} features=11008 "
                  "threads=256 rows=1")
    assert other_act.startswith("ERR ") and "another activation than the node's 'gelu_erf'" in \
        other_act
    assert with_bias.startswith("ERR ") and "has cuBLASLt add it" in with_bias
    assert not_glu.startswith("ERR ") and "not a stofc gated-activation kernel" in not_glu
    assert empty.startswith("ERR ") and "attribute 'epilogue_kernel'" in empty
    assert no_width.startswith("ERR ") and "does not give its row width" in no_width
    assert warps.startswith("ERR ") and "whole warps" in warps
    assert no_abi.startswith("ERR ") and "GatedGemm node carries no CUDA launch attributes" in \
        no_abi


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gated_kernels_the_lowering_names_parse(driver, dtype):
    """Every gated-activation kernel the package writer names (twins.gated_epilogue_kernel,
    tuned shape or default) is accepted by the CUDA twin for its activation."""
    from stofc.kernels.glu import GatedConfig
    from stofc.lower.twins import gated_epilogue_kernel, gated_launch_attributes

    cases = []
    for act in ("silu", "gelu_erf", "gelu_tanh", "relu"):
        for f, cfg in ((1408, None), (96, GatedConfig(32, 4)), (11008, GatedConfig(512, 2))):
            kernel = gated_epilogue_kernel(act, f, dtype, cfg)
            cases.append((act, f, kernel, gated_launch_attributes(kernel, "kernels/g.cubin")))
    out = ask(driver, *((f"glu:{act}", attrs) for act, _, _, attrs in cases))
    for (_, f, kernel, attrs), line in zip(cases, out, strict=True):
        assert line == (f"OK bf16={int(dtype == 'bfloat16')} file=kernels/g.cubin "
                        f"entry={kernel.name} features={f} threads={attrs['epilogue_threads']} "
                        f"rows={attrs['epilogue_rows']}"), line


def test_epilogue_tags_equal_python_epilogue_tags(driver):
    eps = [Epilogue(bias=b, act=a, residual=r, norm=n, norm_shift=s, store_pre_norm=p)
           for b, a, r, n, s, p in itertools.product(
               (False, True), ("none", "gelu_erf", "gelu_tanh", "relu"), (False, True),
               ("none", "layernorm", "rmsnorm"), (False, True), (False, True))
           if not (p and n == "none")]
    out = ask(driver, *(("tag", {"tag": ep.tag}) for ep in eps))
    assert out == [f"OK tag={ep.tag}" for ep in eps]


def test_fused_gemm_split_equals_python(driver):
    combos = list(itertools.product((0, 1), ("none", "gelu_erf", "gelu_tanh"), (0, 1), (0, 1)))
    out = ask(driver, *(("gemm_split", {"bias": b, "act": a, "residual": r, "after": f})
                        for b, a, r, f in combos))
    for (b, a, r, f), line in zip(combos, out, strict=True):
        s = split_fused_gemm(bool(b), a, bool(r), bool(f))
        assert line == (f"OK lt_epilogue={s.lt_epilogue} lt_residual={int(s.lt_residual)} "
                        f"rest={s.rest.tag}")
    (bad,) = ask(driver, ("gemm_split", {"act": "relu"}))
    assert bad.startswith("ERR ") and "activation='relu'" in bad


def test_add_layer_norm_epilogue_equals_python(driver):
    combos = list(itertools.product((0, 1), repeat=4))
    out = ask(driver, *(("norm_epilogue", {"residual": r, "rms": m, "beta": b, "sum": s})
                        for r, m, b, s in combos))
    for (r, m, b, s), line in zip(combos, out, strict=True):
        ep = norm_epilogue(has_residual=bool(r), rms=bool(m), has_beta=bool(b), has_sum=bool(s))
        if ep is None:
            assert line.startswith("ERR ") and "RMSNorm with a shift" in line
        else:
            assert line == f"OK tag={ep.tag}"


def test_launch_plan_reader_accepts_plans_and_rejects_damage(driver, tmp_path):
    fmt = encode("dilated:window=256,dilation=2", 1000)
    data = launch_data(fmt, AttentionConfig("block", 64, 16, 4, 2, 1, permute=True))
    good = encode_attention_plan(data)
    files = {"good": good, "truncated": good[:-8], "magic": b"X" + good[1:]}
    damaged = bytearray(good)
    first_key = PLAN_HEADER_BYTES + 8 * -(-data.row_ptr.nbytes // 8)   # col_idx[0]
    damaged[first_key:first_key + 4] = np.int32(-10_000).tobytes()
    files["key"] = bytes(damaged)
    paths = {}
    for name, blob in files.items():
        paths[name] = tmp_path / f"{name}.plan.bin"
        paths[name].write_bytes(blob)
    out = dict(zip(files, ask(driver, *(("plan", {"path": str(p)}) for p in paths.values())),
                   strict=True))
    walked = data.col_idx.size - 1
    assert out["good"] == (f"OK kind=block tile=64 rows={fmt.tile_rows} heads=1 permuted=1 walked={walked} "
                           f"orders={fmt.tile_rows * (fmt.tile_rows + 1) // 2}")
    assert out["truncated"].startswith("ERR ") and "is corrupt" in out["truncated"]
    assert out["magic"].startswith("ERR ") and "bad magic" in out["magic"]
    assert out["key"].startswith("ERR ") and "tile key out of range" in out["key"]


# ---------------------------------------------------------------- launch scalars vs AttentionOp

from tests.unit.test_ortlib_abi import CASES, abi_table, cpu_runtime  # noqa: E402, F401


@pytest.mark.parametrize("spec,L,config", CASES, ids=[c[2].describe() for c in CASES])
def test_cuda_launch_scalars_equal_attention_op_bind(driver, cpu_runtime, tmp_path, spec, L,  # noqa: F811
                                                     config):
    import stofc.runtime.attention as rt
    from stofc.package.maskbin import write_attention_plan
    from stofc.targets import get_profile

    fmt = encode(spec, L)
    path = write_attention_plan(launch_data(fmt, config), tmp_path / "a.plan.bin")
    heads, head_dim = 3, 64
    op = rt.AttentionOp(fmt, config, "float16", head_dim, profile=get_profile("h100"))
    op._kernel = lambda has_bias, has_key_bits, has_softcap: (None,)
    per_row = config.q_split if config.kind == "block" else config.tile // config.rows_per_block
    rng = np.random.default_rng(1)
    names = [n for n, _ in abi_table()]
    for batch, seq, kpm, bias_b, bias_h in ((1, L, False, 0, 0), (2, L - 37, True, 0, 0),
                                            (3, 65, True, 1, heads), (2, 130, False, 2, 1)):
        q, k, v = (rng.standard_normal((batch, seq, heads, head_dim)).astype(np.float16)
                   for _ in range(3))
        kw: dict = {"scale": 0.125}
        if kpm:
            kw["key_mask"] = np.ones((batch, seq), np.int64)
        if bias_b:
            kw["bias"] = np.zeros((bias_b, bias_h, seq, seq), np.float16)
        launch = op.bind(q, k, v, **kw)
        want = dict(zip(names, launch.args, strict=True))
        bias_sb = 0 if bias_b in (0, 1) else bias_h * seq * seq
        bias_sh = 0 if bias_h in (0, 1) else seq * seq
        (line,) = ask(driver, ("pack", {"path": str(path), "B": batch, "S": seq, "H": heads,
                                        "D": head_dim, "kpm": int(kpm), "bias": int(bias_b > 0),
                                        "bias_sb": bias_sb, "bias_sh": bias_sh,
                                        "per_row": per_row, "scale_milli": 125}))
        got = dict(item.split("=") for item in line.removeprefix("OK ").split())
        rows = int(got["rows"])
        assert int(got["grid"]) == launch.grid
        start = int(got["order_offset"])
        data = launch_data(fmt, config)
        assert np.array_equal(data.row_orders[start:start + rows], np.asarray(want["row_order"]))
        for name in ("q_sb", "q_ss", "q_sh", "k_sb", "k_ss", "k_sh", "v_sb", "o_sh", "permuted",
                     "fmt_head_stride", "key_words", "bias_sb", "bias_sh", "bias_sq", "B", "H",
                     "L"):
            key = name if name in got else "q_" + name[2:]
            assert int(got[key]) == int(want[name]), name
        assert float(got["scale"]) == float(want["scale"])


@pytest.fixture(scope="module")
def key_prep(tmp_path_factory) -> Path:
    """cuda/ort/key_prep.cu built for the host (one thread per block; tests/key_prep_host.cc)."""
    exe = tmp_path_factory.mktemp("keyprep") / "key_prep"
    res = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror",
                          str(sources_dir() / "tests" / "key_prep_host.cc"), "-o", str(exe)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return exe


@pytest.mark.parametrize("kpm_type", [0, 1, 2, 3], ids=["none", "int64", "int32", "bool"])
def test_key_prep_equals_attention_op_bind(key_prep, cpu_runtime, kpm_type):  # noqa: F811
    """kv_len and the packed key bits the CUDA twin computes = what AttentionOp.bind passes."""
    import stofc.runtime.attention as rt
    from stofc.targets import get_profile

    fmt = encode("sliding:window=96", 300)
    op = rt.AttentionOp(fmt, AttentionConfig("row", 64, 2, 4), "float16", 64,
                        profile=get_profile("h100"))
    op._kernel = lambda has_bias, has_key_bits, has_softcap: (None,)
    rng = np.random.default_rng(kpm_type)
    names = [n for n, _ in abi_table()]
    for batch, seq in ((1, 1), (3, 64), (4, 130), (2, 300)):
        mask = (rng.random((batch, seq)) < 0.8).astype(np.int64)
        mask[0, -1] = 1
        if batch > 1:
            mask[1] = 0                                   # a sequence without any real key
        if batch > 2:
            mask[2, seq // 2:] = 0                        # right padding
        q = np.zeros((batch, seq, 1, 64), np.float16)
        launch = op.bind(q, q, q, **({"key_mask": mask} if kpm_type else {}))
        want = dict(zip(names, launch.args, strict=True))
        text = f"{kpm_type} {batch} {seq}\n" + (" ".join(map(str, mask.ravel())) if kpm_type else "")
        res = subprocess.run([str(key_prep)], input=text + "\n", capture_output=True, text=True,
                             check=True)
        kv_line, words_line = res.stdout.split("\n")[:2]
        assert [int(x) for x in kv_line.split()] == np.asarray(want["kv_len"]).tolist()
        if kpm_type:
            words = np.array([int(x) for x in words_line.split()], dtype=np.uint64)
            assert int(want["key_words"]) == -(-seq // 64)
            assert np.array_equal(words, np.asarray(want["key_bits"]).ravel())


ROTARY_ENTRY = "stofc_rotary_bfloat16_d128_r64_rh_v8_t128"
ROTARY_OK = {"kernel_abi": 4, "kernel": f"kernels/r.sm_90.cubin:{ROTARY_ENTRY}", "head_dim": 128,
             "rotary_dim": 64, "interleaved": 0}


def test_valid_rotary_attributes_parse(driver):
    from stofc.kernels.rotary import RotaryConfig, RotaryProblem, kernel_name

    (line,) = ask(driver, ("rotary", ROTARY_OK))
    assert line == (f"OK bf16=1 file=kernels/r.sm_90.cubin entry={ROTARY_ENTRY} vec=8 "
                    "threads=128")
    for problem in (RotaryProblem("float16", 80, 20, True), RotaryProblem("bfloat16", 32, 16,
                                                                          False)):
        name = kernel_name(problem, RotaryConfig(256))   # what the package writes parses
        (line,) = ask(driver, ("rotary", {"kernel_abi": 4, "kernel": f"r.cubin:{name}",
                                          "head_dim": problem.head_dim,
                                          "rotary_dim": problem.rotary_dim,
                                          "interleaved": int(problem.interleaved)}))
        assert line == (f"OK bf16={int(problem.dtype == 'bfloat16')} file=r.cubin entry={name} "
                        f"vec={problem.vec} threads=256")


BAD_ROTARY = [
    ({"kernel_abi": None}, "carries no CUDA launch attributes (kernel_abi 4)"),
    ({"kernel": None}, "attribute 'kernel' (FILE.cubin:ENTRY of the rotary kernel) is required"),
    ({"kernel": "r.cubin:stofc_glu_float16_silu_f8_t32x4"}, "not a stofc rotary kernel"),
    ({"kernel": "r.cubin:stofc_rotary_float32_d128_r64_rh_v8_t128"}, "not a stofc rotary kernel"),
    ({"kernel": "r.cubin:stofc_rotary_float16_d128_rx_rh_v8_t128"}, "not a stofc rotary kernel"),
    ({"rotary_dim": 32}, "compiled for head_dim 128, rotary_dim 64, rh but the node has head_dim "
                         "128, rotary_dim 32, rh"),
    ({"interleaved": 1}, "but the node has head_dim 128, rotary_dim 64, il"),
    ({"kernel": "r.cubin:stofc_rotary_float16_d128_r64_rh_v3_t128"}, "vectors of 3 elements"),
    ({"kernel": "r.cubin:stofc_rotary_float16_d128_r64_rh_v8_t100"}, "100 threads per block"),
]


@pytest.mark.parametrize("change,message", BAD_ROTARY, ids=[m[:40] for _, m in BAD_ROTARY])
def test_bad_rotary_attributes_are_one_line_errors(driver, change, message):
    attrs = {k: v for k, v in {**ROTARY_OK, **change}.items() if v is not None}
    (line,) = ask(driver, ("rotary", attrs))
    assert line.startswith("ERR ") and message in line, line
