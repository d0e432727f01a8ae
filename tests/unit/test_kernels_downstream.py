"""Downstream kernel families without a GPU: spaces, rendering, NVRTC compiles, references.

Compiles a representative set covering every family, every epilogue flag, both
stores, fp16/bf16, for sm_80 and sm_90 (sm_86/sm_89 for a subset), plus the
default config of every segment of the post-LN, pre-LN and RMSNorm plans.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from stofc.compile import compile_source
from stofc.kernels import gemm, gemm_gemm, norm
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.reference import apply_epilogue, attention_dense, gelu, layernorm, rmsnorm
from stofc.kernels.space import Space, check
from stofc.plan.build import build_plan
from stofc.plan.reference import reference_chain
from stofc.plan.synthetic import bert_layer, gpt2_layer, random_weights, t5_layer
from stofc.targets import get_profile

H100 = get_profile("h100")
A100 = get_profile("a100")

EPILOGUES = [
    Epilogue(),
    Epilogue(bias=True),
    Epilogue(bias=True, act="gelu_erf"),
    Epilogue(bias=True, act="gelu_tanh", residual=True),
    Epilogue(act="relu"),
    Epilogue(bias=True, residual=True, norm="layernorm"),
    Epilogue(residual=True, norm="layernorm", norm_shift=False, store_pre_norm=True),
    Epilogue(residual=True, norm="rmsnorm", norm_shift=False, store_pre_norm=True),
]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def _gemm_sources():
    out = []
    for i, ep in enumerate(EPILOGUES):
        dtype = ("float16", "bfloat16")[i % 2]
        n = 768 if ep.norm != "none" else 2304
        store = "heads" if i == 1 else "row"
        problem = gemm.GemmProblem(4096, n, 768, dtype, ep, store)
        out.append(gemm.render_gemm(problem, gemm.default_config(problem, H100)))
    return out


def _norm_sources():
    out = []
    for i, ep in enumerate(EPILOGUES[1:]):
        dtype = ("bfloat16", "float16")[i % 2]
        n = (768, 1024, 3072, 512)[i % 4]
        problem = norm.NormProblem(4096, n, dtype, ep)
        out.append(norm.render_norm(problem, norm.default_config(problem, H100)))
    return out


def _gemm_gemm_sources():
    out = []
    for dtype, ep1, ep2, k, f in (
            ("float16", Epilogue(bias=True, act="gelu_erf"), Epilogue(bias=True, residual=True),
             768, 3072),
            ("bfloat16", Epilogue(act="relu"), Epilogue(residual=True), 512, 2048),
            ("float16", Epilogue(bias=True, act="gelu_tanh"), Epilogue(bias=True), 1024, 4096)):
        problem = gemm_gemm.GemmGemmProblem(128, k, f, k, dtype, ep1, ep2)
        cfg = gemm_gemm.default_config(problem, H100)
        assert cfg.split > 1 and cfg.to_workspace(problem)  # few rows: split hidden dim
        out.append(gemm_gemm.render_gemm_gemm(problem, cfg))
    direct = gemm_gemm.GemmGemmProblem(8192, 768, 3072, 768, "float16",
                                       Epilogue(bias=True, act="gelu_tanh"),
                                       Epilogue(bias=True, residual=True))
    cfg = gemm_gemm.default_config(direct, H100)
    assert cfg.split == 1 and not cfg.to_workspace(direct)
    out.append(gemm_gemm.render_gemm_gemm(direct, cfg))
    fin = norm.NormProblem(128, 768, "bfloat16", Epilogue(bias=True, residual=True,
                                                          norm="layernorm"), input_fp32=True)
    out.append(norm.render_norm(fin, norm.default_config(fin, H100)))
    return out


ALL = _gemm_sources() + _norm_sources() + _gemm_gemm_sources()


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", ALL, ids=[s.name[:60] for s in ALL])
def test_every_family_compiles(source, target):
    kernel = compile_source(source, target)
    assert kernel.binary[:4] == b"\x7fELF"
    assert kernel.entry_points == (source.name,)
    assert source.name.encode() in kernel.binary


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("target", ["sm_86", "sm_89"])
@pytest.mark.parametrize("source", [ALL[0], ALL[5], ALL[-3], ALL[len(_gemm_sources())]],
                         ids=["gemm", "gemm_norm", "gemm_gemm", "add_norm"])
def test_subset_compiles_for_ampere_and_ada(source, target):
    assert compile_source(source, target).binary[:4] == b"\x7fELF"


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("layers", [[bert_layer()], [gpt2_layer()], [t5_layer()]],
                         ids=["post-ln", "pre-ln", "rmsnorm"])
@pytest.mark.parametrize("tokens", [32, 4096])
def test_plan_kernels_render_and_compile(layers, tokens):
    from stofc.runtime import segments

    plan = build_plan(layers, None, H100, dtype="float16", max_seq_len=tokens)
    compiled = 0
    for seg in plan.layers[0].segments:
        if seg.family == "attention":
            continue
        source = _source_for(seg, segments)
        assert compile_source(source, "sm_90").binary[:4] == b"\x7fELF"
        compiled += 1
    assert compiled >= 4


def _source_for(seg, segments):
    spec, ep = seg.kernel, seg.epilogues[-1]
    if spec.template == "vendor/cublas":
        return norm.render_norm(norm.NormProblem(1, seg.dim("n0"), "float16", ep),
                                norm.NormConfig(spec.param("tpr"), spec.param("rows")))
    if seg.family == "add_norm":
        return norm.render_norm(norm.NormProblem(1, seg.dim("n"), "float16", ep),
                                norm.NormConfig(spec.param("tpr"), spec.param("rows")))
    if seg.family == "gemm_gemm":
        cfg = gemm_gemm.GemmGemmConfig(*(spec.param(k) for k in
                                         ("bm", "bh", "bk", "warps", "stages")))
        p = gemm_gemm.GemmGemmProblem(1, seg.dim("k0"), seg.dim("n0"), seg.dim("n1"),
                                      "float16", seg.epilogues[0], seg.epilogues[1])
        return gemm_gemm.render_gemm_gemm(p, cfg)
    cfg = gemm.GemmConfig(*(spec.param(k) for k in
                            ("bm", "bn", "bk", "warps_m", "warps_n", "stages")))
    p = gemm.GemmProblem(1, seg.dim("n0"), seg.dim("k0"), "float16", ep, spec.param("store"))
    return gemm.render_gemm(p, cfg)


def test_templates_are_logic_free():
    from stofc.paths import templates_dir

    for name in ("gemm/gemm.cu.j2", "gemm/gemm_gemm.cu.j2", "norm/add_norm.cu.j2"):
        text = (templates_dir() / name).read_text()
        assert "{%" not in text, f"{name} holds template logic"


def test_render_is_deterministic_and_named():
    p = gemm.GemmProblem(4096, 2304, 768, "float16", Epilogue(bias=True), "heads")
    c = gemm.default_config(p, H100)
    a, b = gemm.render_gemm(p, c), gemm.render_gemm(p, c)
    assert a.code == b.code and a.sha256 == b.sha256
    assert "STORE_HEADS = 1" in a.code and a.name.startswith("stofc_gemm_float16_b_heads")


def test_spaces_prune_with_reasons():
    p = gemm.GemmProblem(4096, 768, 768, "float16",
                         Epilogue(bias=True, residual=True, norm="layernorm"))
    space = gemm.space(p, A100)
    configs = space.configs()
    assert configs and all(c["bn"] >= 768 for c in configs)
    reasons = space.explain()
    assert reasons["valid"] == len(configs)
    assert any("shared memory" in r for r in reasons)
    assert any("spill" in r for r in reasons)
    # the default config is one of the space's valid configs
    d = gemm.default_config(p, A100)
    assert space.reason({"bm": d.bm, "bn": d.bn, "bk": d.bk, "warps_m": d.warps_m,
                         "warps_n": d.warps_n, "stages": d.stages}) is None
    nspace = norm.space(norm.NormProblem(4096, 768, "float16", Epilogue(norm="layernorm")), H100)
    assert nspace.configs() and "too many threads per row" in " ".join(nspace.explain())
    gg = gemm_gemm.GemmGemmProblem(128, 768, 3072, 768, "float16", Epilogue(), Epilogue())
    gspace = gemm_gemm.space(gg, H100)
    assert gspace.configs() and any("shared memory" in r for r in gspace.explain())


def test_space_check_primitive():
    def rule(env):
        check(env["a"] < 3, "a too big")
    space = Space(axes=(("a", (1, 2, 3, 4)),), constraints=(rule,))
    assert [c["a"] for c in space.configs()] == [1, 2]
    assert space.explain() == {"valid": 2, "a too big": 2}
    assert space.reason({"a": 4}) == "a too big" and space.size == 4


def test_references_match_closed_forms():
    x = np.linspace(-4, 4, 101)
    assert np.allclose(gelu(x), [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x],
                       atol=1e-15)
    assert np.max(np.abs(gelu(x, "tanh") - gelu(x))) < 2e-3  # the tanh form's known error
    rng = np.random.default_rng(0)
    v = rng.standard_normal((5, 64))
    g, b = rng.standard_normal(64), rng.standard_normal(64)
    y = layernorm(v, g, b, 1e-5)
    assert np.allclose(((y - b) / g).mean(axis=-1), 0, atol=1e-12)
    assert np.allclose(((y - b) / g).var(axis=-1), 1 / (1 + 1e-5 / v.var(axis=-1)), atol=1e-9)
    r = rmsnorm(v, g, 1e-6)
    assert np.allclose(r / g, v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-6))
    out, pre = apply_epilogue(v, Epilogue(bias=True, act="relu", residual=True,
                                          norm="layernorm", store_pre_norm=True),
                              bias=b, residual=v, gamma=g, beta=b, eps=1e-5)
    assert np.allclose(pre, np.maximum(v + b, 0) + v)
    assert np.allclose(out, layernorm(pre, g, b, 1e-5))


def test_reference_chain_equals_hand_written_bert_layer():
    layer = bert_layer(64, 4, 128)
    rng = np.random.default_rng(1)
    w = random_weights(layer, rng)
    x = rng.standard_normal((2 * 8, 64))
    env = reference_chain(layer, {"L0/input": x}, w,
                          lambda ins: attention_dense(ins[0], 2, 4, 0.25))
    p = "L0/"
    qkv = x @ w[p + "qkv.weight"] + w[p + "qkv.bias"]
    a = attention_dense(qkv, 2, 4, 0.25)
    h = layernorm(a @ w[p + "out.weight"] + w[p + "out.bias"] + x, w[p + "ln_ffn.gamma"],
                  w[p + "ln_ffn.beta"], 1e-5)
    f = gelu(h @ w[p + "ffn_in.weight"] + w[p + "ffn_in.bias"])
    y = layernorm(f @ w[p + "ffn_out.weight"] + w[p + "ffn_out.bias"] + h,
                  w[p + "ln_out.gamma"], w[p + "ln_out.beta"], 1e-5)
    assert np.allclose(env[p + "ln_out.out"], y, rtol=1e-12, atol=1e-12)
