"""The EmbedLayerNorm kernel family without a GPU: names, defaults, the family's spec round trip,
the rewrite's width rule and NVRTC compiles of every template variant.

``norm/embed_norm.cu.j2`` compiles with NVRTC for sm_80 and sm_90 in float16 and bfloat16 with
1, 2 and 3 summands, with and without beta, gamma / beta in the element type and in float32, for
BERT-base to large widths (one warp per row up to 1024, several beyond); the entry point is the
name the CUDA twin parses (``parse_embed_norm_launch``).
"""

from __future__ import annotations

import itertools

import pytest

from stofc.compile import compile_source
from stofc.errors import PlanError
from stofc.kernels import catalog
from stofc.kernels.embed_norm import (
    EmbedNormConfig,
    EmbedNormProblem,
    default_config,
    embed_norm_kernel,
    kernel_name,
    render_embed_norm,
    supported_width,
)
from stofc.targets import get_profile


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def test_names_and_defaults():
    p = EmbedNormProblem("float16", 768, 3, True)
    assert default_config(p) == EmbedNormConfig(32, 4)          # BERT-base: 3 vectors a lane
    assert embed_norm_kernel(p).name == "stofc_embed_norm_float16_e3_ln_n768_t32x4"
    p = EmbedNormProblem("bfloat16", 4096, 2, False, params_fp32=True)
    assert default_config(p) == EmbedNormConfig(128, 1)
    assert kernel_name(p, EmbedNormConfig(64, 2)) == \
        "stofc_embed_norm_bfloat16_f32p_e2_ln_ns_n4096_t64x2"
    with pytest.raises(PlanError, match="width 100 is not a positive multiple of 8"):
        embed_norm_kernel(EmbedNormProblem("float16", 100, 3, True))
    with pytest.raises(PlanError, match="sums 1 to 3 tables, not 4"):
        embed_norm_kernel(EmbedNormProblem("float16", 768, 4, True))
    with pytest.raises(PlanError, match="float16 or bfloat16, not float32"):
        embed_norm_kernel(EmbedNormProblem("float32", 768, 3, True))
    assert supported_width(768) and supported_width(32768)
    assert not supported_width(100) and not supported_width(0) and not supported_width(40960)


def test_the_family_round_trips_its_spec_and_prunes_with_a_reason():
    fam = catalog.family("embed_norm")
    p = EmbedNormProblem("float16", 1024, 3, True)
    config = fam.default(p, get_profile("h100"))
    assert fam.config_of(fam.spec(p, config), p) == config
    configs, pruned = fam.candidates(p, get_profile("h100"))
    assert config in configs and EmbedNormConfig(32, 1) not in configs
    assert "fewer than 2 warps per block under-fills the SM" in pruned
    assert fam.kernels(p, config)[0].name == kernel_name(p, config)
    assert not fam.tunable


VARIANTS = [EmbedNormProblem(dtype, width, summands, beta, fp32)
            for dtype, (width, summands), beta, fp32 in itertools.product(
                ("float16", "bfloat16"), ((768, 3), (1024, 2), (4096, 1), (136, 3)),
                (True, False), (False, True))
            if not (fp32 and dtype == "float16" and width != 768)]


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("problem", VARIANTS,
                         ids=[kernel_name(p, default_config(p)) for p in VARIANTS])
def test_every_embed_norm_variant_compiles(problem, target):
    source = render_embed_norm(problem, default_config(problem))
    kernel = compile_source(source, target)
    assert kernel.binary[:4] == b"\x7fELF"
    assert kernel.entry_points == (source.name,)
    assert source.name.encode() in kernel.binary
