"""The Rotary op's kernel family without a GPU: names, vector widths, the family's spec round
trip and NVRTC compiles of every template variant.

``rope/rotary.cu.j2`` compiles with NVRTC for sm_80 and sm_90 in float16 and bfloat16 for
rotate-half and interleaved pairs, the whole head and partial rotary dimensions (Phi-3's half,
GPT-NeoX's quarter) and every vector width the family picks (8, 4, 2, 1); the entry point is
the name the CUDA twin parses (``parse_rotary_launch``).
"""

from __future__ import annotations

import itertools

import pytest

from stofc.compile import compile_source
from stofc.errors import PlanError
from stofc.kernels import catalog
from stofc.kernels.rotary import (
    RotaryConfig,
    RotaryProblem,
    kernel_name,
    render_rotary,
    rotary_kernel,
)
from stofc.targets import get_profile


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


# (head_dim, rotary_dim): Llama (128, 128), Phi-3 mini (96, 96 / partial 48), GPT-NeoX-20B
# (96, 24), Phi-2 (80, 32), StableLM (64, 16), odd vector widths (36, 4: vec 2), (30, 10)
SHAPES = [(128, 128), (96, 48), (96, 24), (80, 32), (64, 16), (36, 4), (30, 10)]
VARIANTS = [RotaryProblem(dtype, d, r, il) for (d, r), dtype, il in itertools.product(
    SHAPES, ("float16", "bfloat16"), (False, True))]


def test_vector_widths_divide_the_walk():
    assert {p.vec for p in VARIANTS} == {8, 4, 2, 1}
    for p in VARIANTS:
        span = p.rotary_dim if p.interleaved else p.rotary_dim // 2
        assert p.head_dim % p.vec == 0 and span % p.vec == 0
        assert p.vec % 2 == 0 or not p.interleaved
    assert RotaryProblem("float16", 30, 10, False).vec == 1   # rotate-half pairs 5 apart


def test_names_say_what_the_twin_checks():
    p = RotaryProblem("bfloat16", 96, 24, True)
    assert kernel_name(p, RotaryConfig(256)) == "stofc_rotary_bfloat16_d96_r24_il_v8_t256"
    assert rotary_kernel(p).name == "stofc_rotary_bfloat16_d96_r24_il_v8_t128"
    with pytest.raises(PlanError, match="rotary_dim 10 is not even and within head_dim 8"):
        rotary_kernel(RotaryProblem("float16", 8, 10, False))
    with pytest.raises(PlanError, match="float16 or bfloat16, not float32"):
        rotary_kernel(RotaryProblem("float32", 64, 64, False))


def test_the_family_round_trips_its_spec_and_prunes_with_a_reason():
    fam = catalog.family("rotary")
    p = RotaryProblem("float16", 64, 32, False)
    config = fam.default(p, get_profile("h100"))
    assert fam.config_of(fam.spec(p, config), p) == config
    configs, pruned = fam.candidates(p, get_profile("h100"))
    assert RotaryConfig(32) not in configs and RotaryConfig(1024) in configs
    assert pruned == {"fewer than 2 warps per block under-fills the SM": 1}
    assert fam.kernels(p, config)[0].name == kernel_name(p, config)


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("problem", VARIANTS, ids=[kernel_name(p, RotaryConfig()) for p in VARIANTS])
def test_every_rotary_variant_compiles(problem, target):
    source = render_rotary(problem, RotaryConfig(256 if problem.head_dim > 64 else 64))
    kernel = compile_source(source, target)
    assert kernel.binary[:4] == b"\x7fELF"
    assert kernel.entry_points == (source.name,)
    assert source.name.encode() in kernel.binary
