"""Fusion schemes, family mapping with rejection reasons, moves, build_plan, plan.json."""

from __future__ import annotations

import json

import pytest

from stofc.errors import PlanError
from stofc.frontend.types import OpKind
from stofc.kernels import catalog
from stofc.kernels.attention import choose_attention
from stofc.kernels.attention.family import NO_ATTENTION_KERNEL
from stofc.masks import encode, parse_mask
from stofc.plan.build import build_plan
from stofc.plan.families import SchemeRejected, match_segments, reject_reason
from stofc.plan.moves import compete, expand, initial_scheme, is_executable, neighbours, seize
from stofc.plan.plan import SCHEMA_VERSION, Plan
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import bert_layer, gpt2_layer, t5_layer
from stofc.targets import get_profile

H100 = get_profile("h100")
BERT_KINDS = ["gemm", "bias_add", "attention", "gemm", "bias_add", "residual_add", "layernorm",
              "gemm", "bias_add", "gelu", "gemm", "bias_add", "residual_add", "layernorm"]


def families(layer, scheme):
    return [m.family for m in match_segments(layer, scheme)]


def test_bert_chain_matches_the_frontend_contract():
    assert [op.kind.value for op in bert_layer().chain] == BERT_KINDS
    pre = gpt2_layer()
    assert pre.chain[0].kind == OpKind.LAYERNORM and pre.chain[-1].kind == OpKind.RESIDUAL_ADD
    t5 = t5_layer()
    assert not t5.ops(OpKind.BIAS_ADD) and t5.ops(OpKind.RMSNORM)


def test_encoding_roundtrip_and_stof_values():
    stof = [0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]  # STOF alternates values
    scheme = FusionScheme.from_values(stof)
    assert scheme.codes == (0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4)
    assert scheme.segments()[1] == (2,)
    assert scheme.boundaries() == (2, 3, 7, 10)
    assert FusionScheme.from_json(json.loads(json.dumps(scheme.to_json()))) == scheme
    assert str(scheme) == "[0 0] 1 [0 0 0 0] [1 1 1] [0 0 0 0]"
    assert FusionScheme.from_segments(scheme.segments()) == scheme
    assert scheme.with_boundaries(scheme.boundaries()) == scheme


@pytest.mark.parametrize("bad", [[], "0 1", [0, 1.5], [True, 0]])
def test_encoding_rejects_garbage(bad):
    with pytest.raises(PlanError):
        FusionScheme.from_json(bad)


def test_non_canonical_codes_rejected():
    with pytest.raises(PlanError, match="not canonical"):
        FusionScheme((0, 2))


def test_initial_scheme_bert_large_tokens():
    layer = bert_layer()
    scheme = initial_scheme(layer, tokens=4096)
    assert str(scheme) == "[0 0] 1 [0 0 0 0] [1 1 1] [0 0 0 0]"
    assert families(layer, scheme) == ["gemm", "attention", "gemm_norm", "gemm", "gemm_norm"]
    eps = [m.epilogues[-1] for m in match_segments(layer, scheme) if m.epilogues]
    assert eps[0].bias and eps[1].norm == "layernorm" and eps[1].residual
    assert eps[2].act == "gelu_erf"


def test_initial_scheme_small_tokens_fuses_ffn_chain():
    layer = bert_layer()
    # off by default (measured slower on H200); the structure is recognised when asked
    assert "gemm_gemm" not in families(layer, initial_scheme(layer, tokens=32))
    chain = initial_scheme(layer, tokens=32, ffn_chain_max_tokens=64)
    fams = families(layer, chain)
    assert fams == ["gemm", "attention", "gemm_norm", "gemm_gemm"]
    ffn = match_segments(layer, chain)[-1]
    assert [e.tag for e in ffn.epilogues] == ["b-gelu_erf", "b-r-ln"]
    # with few rows per SM the norm stays out of the GEMM (full-row tiles under-fill)
    fams = families(layer, initial_scheme(layer, tokens=128, norm_fusion_min_tokens=2112,
                                          ffn_chain_max_tokens=256))
    assert fams == ["gemm", "attention", "gemm", "add_norm", "gemm_gemm"]


def test_gemm_gemm_may_end_with_a_norm():
    layer = bert_layer()
    scheme = FusionScheme.from_values([0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3])
    assert families(layer, scheme)[-1] == "gemm_gemm"


def test_pre_ln_stores_the_residual_stream():
    layer = gpt2_layer()
    matches = match_segments(layer, initial_scheme(layer, tokens=4096))
    assert [m.family for m in matches] == ["add_norm", "gemm", "attention", "gemm_norm",
                                           "gemm", "gemm"]
    out_proj = matches[3]
    assert out_proj.epilogues[0].store_pre_norm  # h = x + attn is the FFN's residual
    assert out_proj.binding("pre_norm_out") == matches[5].binding("residual")
    assert matches[4].epilogues[0].act == "gelu_tanh"


def test_t5_rmsnorm_no_bias():
    layer = t5_layer()
    matches = match_segments(layer, initial_scheme(layer, tokens=4096))
    norm = next(m for m in matches if m.family == "gemm_norm")
    assert norm.epilogues[0].norm == "rmsnorm" and not norm.epilogues[0].norm_shift
    assert [m.epilogues[0].act for m in matches if m.family == "gemm"][1] == "relu"


def test_wide_rows_cannot_fuse_the_norm():
    layer = bert_layer(2048, 16, 8192)
    scheme = FusionScheme.from_values([0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4])
    reason = reject_reason(layer, scheme)
    assert reason and "full row" in reason and "2048 > 1024" in reason
    assert "gemm_norm" not in families(layer, initial_scheme(layer, tokens=4096))


@pytest.mark.parametrize("values,needle", [
    ([0] * 14, "attention operator must be a segment of its own"),
    ([0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], "3 compute-intensive"),
    ([0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3], "3 compute-intensive"),
    ([0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3], "norm followed by a GEMM"),
    ([0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4], "attention operator must be"),
])
def test_rejections_carry_the_reason(values, needle):
    layer = bert_layer()
    with pytest.raises(SchemeRejected) as info:
        match_segments(layer, FusionScheme.from_values(values))
    assert needle in info.value.reason
    assert "\n" not in str(info.value)


def test_intermediate_needed_outside_is_rejected():
    # pre-LN: residual_add output h feeds the final residual; a gemm segment that ends
    # with bias+residual cannot also feed it to the norm unless it is a norm family
    layer = gpt2_layer()
    cut = FusionScheme.unfused(len(layer.chain)).with_boundaries([1, 3, 4, 8])
    # segment [gemm out, bias, residual, ln_ffn] is gemm_norm storing h; fine
    assert is_executable(layer, cut)
    # the FFN segment [gemm, bias, gelu, gemm, bias, residual]: gelu output used inside only
    assert families(layer, cut)[-1] == "gemm_gemm"


def test_wrong_length_scheme():
    with pytest.raises(PlanError, match="14 operators"):
        match_segments(bert_layer(), FusionScheme.unfused(3))


def test_moves_are_executable_and_keep_attention_fixed():
    layer = bert_layer()
    start = FusionScheme.unfused(len(layer.chain))
    moves = neighbours(layer, start)
    assert {m.kind for m in moves} == {"expand"}  # no MI segment has 2 ops to seize from
    att = 2
    for move in moves:
        assert is_executable(layer, move.scheme)
        seg = move.scheme.segment_of(att)
        assert move.scheme.segments()[seg] == (att,)
    assert expand(layer, start, 2, "left") is None  # attention never merges
    grown = expand(layer, start, 0, "right")
    assert grown is not None and grown.segments()[0] == (0, 1)


def test_seize_and_compete():
    layer = bert_layer()
    # [gemm] [bias residual] [ln]: seize moves bias into the GEMM segment
    scheme = FusionScheme.from_values([0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    after = seize(layer, scheme, 3, "right")
    assert after is not None and after.segments()[3] == (3, 4)
    assert seize(layer, scheme, 2, "right") is None  # attention is fixed
    assert any(m.kind == "seize" for m in neighbours(layer, scheme))
    # an MI-only segment [bias, gelu] between two GEMMs goes to one of them
    scheme = FusionScheme.from_values([0, 0, 1, 2, 2, 2, 2, 3, 4, 4, 5, 5, 5, 5])
    won = compete(layer, scheme, 4)
    assert won is not None and won.segments()[3] == (7, 8, 9)


def test_build_plan_post_pre_rms_and_json_roundtrip():
    layers = [bert_layer(index=0), gpt2_layer(index=1), t5_layer(index=2)]
    fmt = encode(parse_mask("bigbird:block=64,window=3,global=1,random=1"), 512, tile=64)
    plan = build_plan(layers, fmt, H100, dtype="float16", max_seq_len=512, batch=8)
    assert plan.arch == "sm_90" and plan.tokens == 4096 and plan.schema == SCHEMA_VERSION
    assert len(plan.layers) == 3
    for lp in plan.layers:
        for seg in lp.segments:
            assert seg.kernel.family == seg.family
            if seg.family in ("gemm", "gemm_norm"):
                assert seg.kernel.template == "vendor/cublas"  # the measured default
            elif seg.family != "attention":
                assert seg.kernel.template.endswith(".cu.j2")
            assert seg.kernel.param("dtype") == "float16"
    text = plan.to_json()
    assert Plan.from_json(text) == plan
    assert len(plan.summary()) == 3 and "gemm_norm" in plan.summary()[0]


def test_head_split_qkv_uses_the_template():
    plan = build_plan([bert_layer()], None, H100, dtype="float16", max_seq_len=512,
                      qkv_store="heads")
    qkv = plan.layers[0].segments[0]
    assert qkv.roles == ("qkv",) and qkv.kernel.template == "gemm/gemm.cu.j2"
    assert qkv.kernel.param("store") == "heads"


def test_plan_json_errors():
    plan = build_plan([bert_layer()], None, H100, dtype="bfloat16", max_seq_len=128)
    data = json.loads(plan.to_json())
    data["schema"] = 99
    with pytest.raises(PlanError, match="schema 99"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")
    del data["layers"]
    data["schema"] = SCHEMA_VERSION
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("kw,needle", [({"dtype": "float32", "max_seq_len": 8}, "dtype"),
                                       ({"dtype": "float16", "max_seq_len": 0}, "positive"),
                                       ({"dtype": "float16", "max_seq_len": 8,
                                         "qkv_store": "x"}, "layout")])
def test_build_plan_user_errors(kw, needle):
    with pytest.raises(PlanError, match=needle):
        build_plan([bert_layer()], None, H100, **kw)


def test_a100_configs_fit_its_shared_memory():
    a100 = get_profile("a100")
    plan = build_plan([bert_layer(1024, 16, 4096)], None, a100, dtype="float16",
                      max_seq_len=128)
    from stofc.kernels.gemm import GemmConfig
    for seg in plan.layers[0].segments:
        if seg.kernel.template == "gemm/gemm.cu.j2":
            cfg = GemmConfig(*(seg.kernel.param(k) for k in
                               ("bm", "bn", "bk", "warps_m", "warps_n", "stages")))
            assert cfg.smem_bytes("float16") <= a100.smem_per_block


def test_attention_segment_uses_the_selector_with_an_encoded_mask():
    fmt = encode(parse_mask("sliding:window=128"), 512, tile=64)
    plan = build_plan([bert_layer()], fmt, H100, dtype="float16", max_seq_len=512, batch=8)
    att = plan.layers[0].segments[1]
    choice, _ = choose_attention(fmt, H100, batch=8, heads=12, seq_len=512, head_dim=64)
    assert att.family == "attention" and att.kernel.template == f"attention/{choice.kernel}.cu.j2"
    config = catalog.family_of(att.kernel).config_of(att.kernel, None)
    assert config == choice.config                     # the selector's base kernel
    assert att.kernel.param("has_bias") is False and att.kernel.param("has_key_bits") is False
    assert plan.mask == fmt.spec_hash
    assert Plan.from_json(plan.to_json()) == plan
    # without masks no attention kernel is chosen, and no family renders the plan's record
    bare = build_plan([bert_layer()], None, H100, dtype="float16",
                      max_seq_len=512).layers[0].segments[1]
    assert bare.kernel == NO_ATTENTION_KERNEL
    with pytest.raises(PlanError, match="no kernel family"):
        catalog.family_of(bare.kernel)
