"""The selector and the tuner know what the node reads besides Q, K and V.

Four consumer warpgroups of the ws kernel (head_dim 64) spill with an additive bias (ptxas:
84-108 bytes; ``ws_cost.ws_spills``, the strict xfails of ``test_attention_ws.KNOWN_SPILLS``)
and then run 17-22% slower than three (H100, ``ws-variants-bias-h100-2026-11-28.jsonl``).
The selector used to pick them for a T5-like layer (head_dim 64 with a relative-position
bias) because it did not know the bias: it now takes the node's
:class:`~stofc.kernels.attention.config.ExtraInputs` through every path (``select_kernel``,
``choose_attention`` and their memo, the plan, the tuner's space and problem key, ``stofc
inspect``), and skips four consumers for a bias. Soft-capping alone (8 bytes of spill, four
still 2-12% faster than three) and key bits alone keep four.
"""

from __future__ import annotations

import types
from dataclasses import replace

import pytest

from stofc.commands.inspect import _mask_report
from stofc.kernels.attention import AttentionConfig, choose_attention, select_kernel
from stofc.kernels.attention.config import ExtraInputs
from stofc.kernels.attention.family import AttentionProblem
from stofc.kernels.attention.ws import AttentionWs
from stofc.kernels.attention.ws_cost import ws_config, ws_spills
from stofc.lower.attention import attention_kernel
from stofc.masks import encode
from stofc.plan.build import build_plan
from stofc.plan.families import match_segments
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import bert_layer
from stofc.targets import get_profile
from stofc.tune.spaces import SpaceFactory

H100 = get_profile("h100")
BIAS, SOFTCAP, KEY_BITS = (ExtraInputs(has_bias=True), ExtraInputs(has_softcap=True),
                           ExtraInputs(has_key_bits=True))
# (batch, heads, seq_len): four consumers are the pick without a bias at head_dim 64
LONG, SHORT = (2, 12, 16384), (4, 12, 2048)


def ws(consumers: int) -> AttentionConfig:
    if consumers == 1:                          # three blocks an SM, no turns
        return AttentionConfig("ws", 64, 16, 8, 3, 1, min_blocks=3, mma="wgmma", pingpong=False)
    return AttentionConfig("ws", 64, 16, 4 * (consumers + 1), 6 if consumers == 4 else 4, 1,
                           mma="wgmma")


def _bias_layer(**attention):
    """BERT-base's layer (12 heads of 64) whose node reads what ``attention`` says."""
    layer = bert_layer(768, 12, 3072)
    return replace(layer, attention=replace(layer.attention, **attention))


T5_LIKE = {"mask_form": "relative_bias", "bias_input": "position_bias"}


def test_the_rule_refuses_four_consumers_with_a_bias():
    for extras in (BIAS, ExtraInputs(True, True, True)):
        why = ws_spills(ws(4), 64, extras)
        assert why and "four consumer warpgroups" in why and "spill" in why
        assert "a bias" in why and "108 bytes" in why and "slower" in why
        assert all(ws_spills(ws(c), 64, extras) is None for c in (2, 3))
    assert ws_spills(ws(4), 64, SOFTCAP) is None           # 8 bytes, and still faster
    assert ws_spills(ws(4), 64, KEY_BITS) is None          # key bits alone: no spill
    assert ws_spills(ws(4), 64, ExtraInputs()) is None


def test_the_rule_refuses_one_consumer_with_a_bias():
    """One consumer warpgroup (136 registers) spills 20 bytes with a bias: refused, with the
    reason; key bits and soft-capping keep it."""
    for extras in (BIAS, ExtraInputs(True, True, True)):
        why = ws_spills(ws(1), 64, extras)
        assert why and "one consumer warpgroup" in why and "20 bytes" in why
    for extras in (SOFTCAP, KEY_BITS, ExtraInputs()):
        assert ws_spills(ws(1), 64, extras) is None


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_the_selector_skips_four_consumers_for_a_bias(mask):
    b, h, n = LONG
    fmt = encode(mask, n)
    shape = {"batch": b, "heads": h, "seq_len": n, "head_dim": 64}
    bare = select_kernel(fmt, H100, **shape)            # first: the memo holds it
    assert bare.kernel == "ws" and bare.config.warps == 20
    for extras in (KEY_BITS, SOFTCAP):
        assert select_kernel(fmt, H100, **shape, extras=extras).config.warps == 20
    for extras in (BIAS, ExtraInputs(True, True, True)):
        choice = select_kernel(fmt, H100, **shape, extras=extras)
        assert choice.kernel == "ws" and choice.config.warps <= 16
        assert ws_spills(choice.config, 64, extras) is None
        assert "rows/block=256" not in choice.explanation     # nothing claims four
        base, _ = choose_attention(fmt, H100, **shape, extras=extras)
        assert base.config == choice.config
        assert ws_config(fmt, H100, batch=b, heads=h, head_dim=64, seq_len=n,
                         extras=extras).warps <= 16
    # the memo keys hold the inputs: a bias-free pick is never returned for a bias node,
    # nor the bias node's for a bias-free one
    assert select_kernel(fmt, H100, **shape) == bare
    assert choose_attention(fmt, H100, **shape)[0].config.warps == 20
    assert ws_config(fmt, H100, batch=b, heads=h, head_dim=64, seq_len=n).warps == 20


def test_the_plan_path_passes_the_bias():
    b, h, n = SHORT
    fmt = encode("causal", n, tile=64)

    def problem(**flags):
        return AttentionProblem(fmt, b, h, 64, n, "float16", **flags)

    assert attention_kernel(problem(), H100, max_seq_len=n).choice.config.warps == 20
    assert attention_kernel(problem(has_softcap=True), H100,
                            max_seq_len=n).choice.config.warps == 20
    for flags in ({"has_bias": True},
                  {"has_bias": True, "has_key_bits": True, "has_softcap": True}):
        kernel = attention_kernel(problem(**flags), H100, max_seq_len=n)
        assert kernel.choice.kernel == "ws" and kernel.choice.config.warps <= 16
        assert AttentionWs().default(problem(**flags), H100).warps <= 16

    # build_plan asks the family (AttentionFamily.choose) with the layer's own inputs
    def planned(layer):
        plan = build_plan([layer], fmt, H100, dtype="float16", max_seq_len=n, batch=b)
        seg = next(s for s in plan.layers[0].segments if s.family == "attention")
        return seg.kernel.param("warps"), seg.kernel.param("has_bias")

    assert planned(bert_layer(768, 12, 3072)) == (20, False)
    warps, has_bias = planned(_bias_layer(**T5_LIKE))
    assert has_bias is True and warps <= 16
    assert planned(_bias_layer(softcap=30.0))[0] == 20


def _attention_space(layer, fmt):
    b, _, n = SHORT
    factory = SpaceFactory(layer, b, n, "float16", H100, fmt, "row")
    unfused = FusionScheme.unfused(len(layer.chain))
    return next(factory(m) for m in match_segments(layer, unfused) if m.family == "attention")


def test_the_tuner_space_leaves_out_the_spilling_configs():
    fmt = encode("causal", SHORT[2], tile=64)
    bare = _attention_space(bert_layer(768, 12, 3072), fmt)
    ws_warps = {c["warps"] for c in bare.configs() if c["kind"] == "ws"}
    assert ws_warps == {8, 12, 16, 20} and bare.default_config()["warps"] == 20
    assert not any("spill" in k for k in bare.prune_reasons())
    softcapped = _attention_space(_bias_layer(softcap=30.0), fmt)
    assert {c["warps"] for c in softcapped.configs() if c["kind"] == "ws"} == {8, 12, 16, 20}
    assert softcapped.problem != bare.problem       # its own records: its kernels differ
    for attention, what in ((T5_LIKE, "a bias"),
                            ({**T5_LIKE, "softcap": 30.0}, "a bias")):
        space = _attention_space(_bias_layer(**attention), fmt)
        configs = [c for c in space.configs() if c["kind"] == "ws"]
        assert configs and {c["warps"] for c in configs} == {12, 16}
        assert space.default_config()["warps"] == 16
        whys = [k for k in space.prune_reasons() if "spill" in k]    # four and one consumer
        assert len(whys) == 2 and all(what in why and space.prune_reasons()[why] > 0
                                      for why in whys)
        assert space.problem != bare.problem        # separate tuning database records


def test_inspect_picks_for_the_models_bias():
    b, _, n = SHORT
    graph = types.SimpleNamespace(layers=[_bias_layer(**T5_LIKE)])
    report = _mask_report("causal", graph, H100, batch=b, seq=n)
    assert report["kernel"] == "ws" and "rows/block=192" in report["why"]
    bare = types.SimpleNamespace(layers=[bert_layer(768, 12, 3072)])
    assert "rows/block=256" in _mask_report("causal", bare, H100, batch=b, seq=n)["why"]
