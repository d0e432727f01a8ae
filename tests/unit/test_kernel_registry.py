"""The kernel-family registry (stofc.kernels.registry) and the registries beside it.

* every built-in family is registered, each by the module that owns it;
* registering a second family under a taken name, or a second owner of a (segment,
  template) pair, fails loudly at import time, and leaves the registry as it was;
  so does a second emitter for a segment kind, a second runtime executor for a
  family and a second attention launch form;
* a new family is one module: registering it makes the planner's lookups find it;
* every planned KernelSpec round-trips through its family's Config.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stofc.codegen import Source
from stofc.errors import RegistryError
from stofc.kernels import catalog, registry
from stofc.kernels.registry import KernelFamily, KernelInstance, register
from stofc.kernels.space import Space
from stofc.kernels.spec import KernelSpec
from stofc.lower.emitters import emits
from stofc.masks import encode, parse_mask
from stofc.plan import families as segment_kinds
from stofc.plan.build import build_plan, segment_context
from stofc.plan.moves import initial_scheme
from stofc.plan.synthetic import bert_layer, gpt2_layer, llama_layer, t5_layer
from stofc.runtime.executors import executes
from stofc.runtime.launches import launches
from stofc.targets import get_profile

H100 = get_profile("h100")

BUILTIN = {
    "add_norm": "stofc.kernels.norm",
    "attention_block": "stofc.kernels.attention.block",
    "attention_row": "stofc.kernels.attention.row",
    "attention_ws": "stofc.kernels.attention.ws",
    "embed_norm": "stofc.kernels.embed_norm",
    "gemm": "stofc.kernels.gemm",
    "gemm_gemm": "stofc.kernels.gemm_gemm",
    "gemm_glu": "stofc.kernels.glu",
    "gemm_norm": "stofc.kernels.gemm_norm",
    "gemm_ws": "stofc.kernels.gemm_ws",
    "glu": "stofc.kernels.glu",
    "ort": "stofc.kernels.ort",
    "rotary": "stofc.kernels.rotary",
    "vendor_gemm": "stofc.kernels.vendor_gemm",
    "vendor_glu": "stofc.kernels.glu",
}


@dataclass(frozen=True)
class ToyConfig:
    width: int = 4


def _toy(name: str, segments: tuple[str, ...], templates: tuple[str, ...]) -> type:
    """A minimal family class (not registered)."""

    class Toy(KernelFamily[int, ToyConfig]):
        config_type = ToyConfig

        def problem(self, seg, ctx):
            return seg.dim("n")

        def space(self, problem, profile):
            return Space(axes=(("width", (2, 4, 8)),), constraints=())

        def default(self, problem, profile):
            return ToyConfig()

        def spec(self, problem, config):
            return KernelSpec(self.segments[0], self.templates[0], (("width", config.width),))

        def config_of(self, spec, problem):
            return ToyConfig(int(spec.param("width")))

        def kernels(self, problem, config):
            return (KernelInstance(self.name, problem, config, f"toy_{config.width}"),)

        def render(self, kernel):
            return Source(kernel.name, "extern \"C\" __global__ void k() {}", "toy/toy.cu.j2",
                          (kernel.name,))

    Toy.name = name
    Toy.segments = segments
    Toy.templates = templates
    return Toy


@pytest.fixture
def clean_registry():
    """The registry's tables as they were, whatever a test registered."""
    families = dict(registry._FAMILIES)
    by_template = dict(registry._BY_TEMPLATE)
    yield
    registry._FAMILIES.clear()
    registry._FAMILIES.update(families)
    registry._BY_TEMPLATE.clear()
    registry._BY_TEMPLATE.update(by_template)


def test_every_builtin_family_is_registered_by_its_module():
    found = {f.name: type(f).__module__ for f in catalog.families()}
    assert found == BUILTIN
    for fam in catalog.families():
        assert fam.segments and fam.templates, fam.name
        assert catalog.family(fam.name) is fam


def test_a_taken_name_fails_loudly_and_changes_nothing(clean_registry):
    before = catalog.families()
    with pytest.raises(RegistryError, match="'gemm' is registered twice"):
        register(_toy("gemm", ("toy",), ("toy/toy.cu.j2",)))
    assert catalog.families() == before
    assert not catalog.families_for("toy")


def test_a_taken_segment_template_pair_fails_loudly(clean_registry):
    before = catalog.families()
    with pytest.raises(RegistryError, match="which 'gemm' owns"):
        register(_toy("gemm_again", ("gemm",), ("gemm/gemm.cu.j2",)))
    assert catalog.families() == before


def test_a_new_family_is_one_registration(clean_registry):
    register(_toy("toy_kind", ("toy",), ("toy/toy.cu.j2",)))
    fam = catalog.family("toy_kind")
    assert catalog.families_for("toy") == (fam,)
    spec = KernelSpec("toy", "toy/toy.cu.j2", (("width", 8),))
    assert catalog.family_of(spec) is fam
    assert fam.config_of(spec, None) == ToyConfig(8)
    configs, pruned = fam.candidates(16, H100)
    assert configs == [ToyConfig(2), ToyConfig(4), ToyConfig(8)] and pruned == {}
    assert catalog.family_of_params("toy", fam.params(ToyConfig(2))) is fam


def test_a_second_emitter_executor_launch_form_or_matcher_fails_loudly():
    with pytest.raises(RegistryError, match="two matchers"):
        segment_kinds.matches("attention")(lambda seg: None)
    with pytest.raises(RegistryError, match="two emitters"):
        emits("gemm")(lambda *a: ([], "", None))
    with pytest.raises(RegistryError, match="two runtime executors"):
        @executes
        class Again:
            families = ("gemm",)
    with pytest.raises(RegistryError, match="two launch forms"):
        launches("attention_block")(type("Again", (), {}))


# the attention family each mask's plan picks on the H100 at (8, 512): block-wise (a +-64
# window), warp-specialised (BigBird): both families' specs round-trip
@pytest.mark.parametrize("mask,attention", [
    ("bigbird:block=64,window=3,global=1,random=1", "attention_ws"),
    ("sliding:window=64", "attention_block")])
def test_planned_specs_round_trip_through_their_family_config(mask, attention):
    layers = [bert_layer(index=0), gpt2_layer(index=1), t5_layer(index=2),
              llama_layer(index=3), llama_layer(index=4, glu="gelu_tanh", bias=True)]
    fmt = encode(parse_mask(mask), 512, tile=64)
    plan = build_plan(layers, fmt, H100, dtype="float16", max_seq_len=512, batch=8)
    seen = set()
    for layer, lp in zip(layers, plan.layers, strict=True):
        for seg in lp.segments:
            fam = catalog.family_of(seg.kernel)
            seen.add(fam.name)
            ctx = segment_context(layer, seg, H100, tokens=plan.tokens, dtype="float16",
                                  fmt=fmt, batch=8, seq_len=512)
            problem = fam.problem(seg, ctx)
            config = fam.config_of(seg.kernel, problem)
            assert isinstance(config, fam.config_type)
            assert fam.spec(problem, config) == seg.kernel, (fam.name, seg.ordinal)
            assert fam.kernels(problem, config)[0].role == "main"
    assert {"vendor_gemm", "add_norm", "vendor_glu", attention} <= seen, seen


@pytest.mark.parametrize("glu", ["silu", "gelu_erf", "gelu_tanh", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_hand_written_gated_specs_round_trip(glu, bias):
    """plan_layer(vendor=False): the gated FFN's segment runs on the hand-written family."""
    from stofc.plan.build import plan_layer

    layer = llama_layer(glu=glu, bias=bias)
    lp = plan_layer(layer, initial_scheme(layer, tokens=512), tokens=512, profile=H100,
                    dtype="bfloat16")
    (seg,) = [s for s in lp.segments if s.family == "gemm_glu"]
    fam = catalog.family_of(seg.kernel)
    assert fam.name == "gemm_glu" and seg.epilogues[0].act == glu
    assert seg.epilogues[0].bias == bias and seg.dim("n0") == 2 * 1408
    problem = fam.problem(seg, segment_context(layer, seg, H100, tokens=512, dtype="bfloat16"))
    config = fam.config_of(seg.kernel, problem)
    assert fam.spec(problem, config) == seg.kernel
    assert fam.from_params(fam.params(config)) == config
    assert catalog.family_of_params("gemm_glu", fam.params(config)) is fam


def test_a_new_segment_kind_is_one_matcher(monkeypatch):
    """A registered matcher claims its segments before the chain grammar; others pass."""
    monkeypatch.setattr(segment_kinds, "_MATCHERS", dict(segment_kinds._MATCHERS))
    layer = bert_layer()
    scheme = initial_scheme(layer, tokens=4096)
    before = segment_kinds.match_segments(layer, scheme)
    claimed = before[-1].ordinal

    @segment_kinds.matches("toy")
    def toy(seg):
        if seg.ordinal != claimed:
            return None
        flow = seg.flows[seg.idx[-1]]
        return segment_kinds.SegmentMatch(seg.ordinal, seg.idx, "toy", (), (), (), 0.0, (),
                                          seg.flows[seg.idx[0]].inputs, (flow.output,))

    after = segment_kinds.match_segments(layer, scheme)
    assert [m.family for m in after] == [m.family for m in before[:-1]] + ["toy"]
    assert after[:-1] == before[:-1]
