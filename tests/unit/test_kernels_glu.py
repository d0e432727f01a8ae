"""The gated FFN's kernel families without a GPU: spaces, rendering, NVRTC compiles, layout.

``vendor_glu``'s gated-activation pass (``gemm/glu.cu.j2``) and ``gemm_glu``'s mma.sync GEMM
with the product in registers (``gemm/gemm_glu.cu.j2``) compile with NVRTC for sm_80 and
sm_90 for every activation (SwiGLU, GeGLU erf / tanh, ReGLU), with and without a bias, in
float16 and bfloat16, and so do the default kernels of planned Llama-like layers. The
hand-written template's interleaved weight layout is checked against the packed one.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from stofc.compile import compile_source
from stofc.kernels import catalog, glu
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.gemm import GemmConfig
from stofc.kernels.reference import gated
from stofc.kernels.registry import PlanContext
from stofc.paths import templates_dir
from stofc.plan.build import build_plan
from stofc.plan.synthetic import llama_layer
from stofc.targets import get_profile

H100, A100 = get_profile("h100"), get_profile("a100")
ACTS = ("silu", "gelu_erf", "gelu_tanh", "relu")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def _gated_sources():
    out = []
    for i, (act, bias) in enumerate(itertools.product(ACTS, (False, True))):
        dtype = ("float16", "bfloat16")[i % 2]
        problem = glu.GatedProblem(4096, (1408, 11008, 768, 96)[i % 4], dtype, act, bias)
        out.append(glu.render_gated(problem, glu.gated_default(problem)))
    return out


def _gemm_glu_sources():
    out = []
    for i, act in enumerate(ACTS):
        dtype, bias = ("bfloat16", "float16")[i % 2], bool(i // 2)
        problem = glu.GluProblem((64, 4096)[i % 2], 1408, 512, dtype, Epilogue(bias=bias, act=act))
        fam = catalog.family("gemm_glu")
        out.append(glu.render_gemm_glu(problem, fam.default(problem, H100)))
    return out


ALL = _gated_sources() + _gemm_glu_sources()


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", ALL, ids=[s.name[:60] for s in ALL])
def test_every_gated_variant_compiles(source, target):
    kernel = compile_source(source, target)
    assert kernel.binary[:4] == b"\x7fELF"
    assert kernel.entry_points == (source.name,)
    assert source.name.encode() in kernel.binary


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("vendor", [True, False], ids=["vendor", "hand-written"])
@pytest.mark.parametrize("tokens", [32, 4096])
def test_planned_gated_kernels_render_and_compile(vendor, tokens):
    """Every kernel of a Llama-like layer's gated segment, as the package builds it."""
    from stofc.lower.program import segment_kernels
    from stofc.lower.twins import gated_epilogue_kernel

    layer = llama_layer(hidden=512, heads=8, ffn=1408)
    plan = build_plan([layer], None, H100, dtype="bfloat16", max_seq_len=tokens)
    (seg,) = [s for s in plan.layers[0].segments if s.family == "gemm_glu"]
    if not vendor:
        fam = catalog.family("gemm_glu")
        problem = fam.problem(seg, PlanContext(tokens, "bfloat16", H100))
        seg = type(seg)(**{**seg.__dict__, "kernel": fam.spec(problem, fam.default(problem,
                                                                                   H100))})
    kernels = [*segment_kernels(seg, "bfloat16"), gated_epilogue_kernel("silu", 1408, "bfloat16")]
    for kernel in kernels:
        source = catalog.family(kernel.family).render(kernel)
        assert compile_source(source, "sm_90").binary[:4] == b"\x7fELF"


def test_templates_are_logic_free():
    for name in ("gemm/glu.cu.j2", "gemm/gemm_glu.cu.j2"):
        assert "{%" not in (templates_dir() / name).read_text(), name


def test_gated_space_prunes_with_reasons_and_holds_the_default():
    for f in (96, 1408, 11008):
        problem = glu.GatedProblem(4096, f, "float16", "silu", False)
        space = glu.gated_space(problem)
        configs = [glu.GatedConfig(**c) for c in space.configs()]
        assert glu.gated_default(problem) in configs
        assert set(space.explain()) - {"valid"}
    small = glu.gated_space(glu.GatedProblem(4096, 96, "float16", "silu", False))
    assert "over half the row's threads would have no 16-byte vector to work on" in \
        small.explain()


@pytest.mark.parametrize("profile", [H100, A100], ids=["h100", "a100"])
def test_vendor_and_hand_written_candidates(profile):
    problem = glu.GluProblem(4096, 1408, 512, "float16", Epilogue(bias=True, act="silu"))
    vendor, hand = catalog.family("vendor_glu"), catalog.family("gemm_glu")
    configs, reasons = vendor.candidates(problem, profile)
    assert vendor.default(problem, profile) in configs
    assert {c.lt for c in configs} == {True, False} and max(c.lt_algo for c in configs) == 7
    assert all(k.startswith(("cublasLt gated kernel: ", "cublas gated kernel: "))
               for k in reasons)
    mma, why = hand.candidates(problem, profile)
    assert hand.default(problem, profile) in mma and all(k.startswith("mma: ") for k in why)
    assert all(isinstance(c, GemmConfig) for c in mma)


def test_the_kernels_bias_follows_the_library():
    """cuBLASLt adds the bias (the gated pass has none); plain cuBLAS leaves it to the pass."""
    fam = catalog.family("vendor_glu")
    problem = glu.GluProblem(4096, 1408, 512, "float16", Epilogue(bias=True, act="gelu_tanh"))
    with_lt, plain = (fam.kernels(problem, glu.VendorGluConfig(lt, 128, 1)) for lt in (True,
                                                                                      False))
    assert not with_lt[0].problem.bias and plain[0].problem.bias
    assert with_lt[0].name == "stofc_glu_float16_gelu_tanh_f1408_t128x1"
    assert plain[0].name == "stofc_glu_float16_gelu_tanh_b_f1408_t128x1"


def test_interleaved_rows_pair_each_gate_with_its_up():
    """The hand-written template's W ([N, K] rows) and bias, interleaved: columns 2f, 2f + 1
    of x @ W^T are gate f and up f, so act(even) * odd is the packed form's gated()."""
    rng = np.random.default_rng(0)
    f, k = 12, 8
    w_nk, b = rng.standard_normal((2 * f, k)), rng.standard_normal(2 * f)  # [Wg | Wu] rows
    x = rng.standard_normal((5, k))
    t = x @ glu.interleave(w_nk).T + glu.interleave(b)
    for act in ACTS:
        want = gated(x @ w_nk.T + b, act)
        np.testing.assert_allclose(gated(np.concatenate([t[:, 0::2], t[:, 1::2]], axis=1), act),
                                   want, rtol=1e-12)
