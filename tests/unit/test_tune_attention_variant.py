"""The tuner measures the attention kernel variant the package deploys (key padding, a
bias, soft-capping or none).

An H200 run showed why it matters: tuned at (4, 2048) without key bits, the search
picked a config 13% slower than the analytical one in the package, whose nodes
receive BERT's attention_mask and so run the key-bit variant. A bias costs more: four ws
consumer warpgroups spill with one and ran 17-22% slower than three (H100,
bench/results/ws-variants-bias-h100-2026-11-28.jsonl).
"""

from __future__ import annotations

from dataclasses import replace

from stofc.masks import encode, parse_mask
from stofc.plan.attention import attention_reads
from stofc.plan.families import match_segments
from stofc.plan.scheme import FusionScheme
from stofc.plan.synthetic import bert_layer
from stofc.targets import get_profile
from stofc.tune.runner_attention import compile_attention
from stofc.tune.spaces import SpaceFactory

H200 = get_profile("h200")


def _attention_space(layer, fmt):
    factory = SpaceFactory(layer, 4, 2048, "float16", H200, fmt, "row")
    unfused = FusionScheme.unfused(len(layer.chain))
    return next(factory(m) for m in match_segments(layer, unfused) if m.family == "attention")


def test_padding_mask_layers_measure_the_key_bit_kernel(monkeypatch):
    fmt = encode(parse_mask("bigbird:block=64,window=3,global=2,random=3"), 2048, tile=64)
    layer = bert_layer(768, 12, 3072)
    block = layer.attention
    padded = replace(layer, attention=replace(block, mask_form="additive",
                                              mask_source="attention_mask"))
    bare = replace(layer, attention=replace(block, mask_form="none", mask_source=None))
    assert attention_reads(padded.attention)[0] and not attention_reads(bare.attention)[0]
    # the model's own constant causal mask is not a padding input
    causal = replace(block, mask_form="additive", mask_source=None, causal_in_graph=True)
    assert not attention_reads(causal)[0]
    sp, sb = _attention_space(padded, fmt), _attention_space(bare, fmt)
    assert sp.payload.key_bits and not sb.payload.key_bits
    assert sp.problem != sb.problem            # separate database records
    compiled = []
    monkeypatch.setattr("stofc.tune.runner_attention.compile_kernel",
                        lambda spec, arch: compiled.append(spec))
    compile_attention(sp.payload, sp.default_config().key)
    compile_attention(sb.payload, sb.default_config().key)
    assert [s.has_key_bits for s in compiled] == [True, False]
    assert "_k1" in compiled[0].name and "_k0" in compiled[1].name


def test_bias_and_softcap_layers_measure_their_kernels(monkeypatch):
    """A T5-like layer (relative-position bias) and a soft-capped one (Gemma 2): the
    payload says so, and the candidate compiled for the measurement is that variant."""
    fmt = encode(parse_mask("causal"), 2048, tile=64)
    layer = bert_layer(768, 12, 3072)
    block = layer.attention
    t5 = replace(layer, attention=replace(block, mask_form="relative_bias",
                                          bias_input="position_bias"))
    capped = replace(layer, attention=replace(block, softcap=50.0))
    st, sc, sb = (_attention_space(x, fmt) for x in (t5, capped, layer))
    assert st.payload.bias and not st.payload.softcap
    assert sc.payload.softcap and not sc.payload.bias
    assert not sb.payload.bias and not sb.payload.softcap
    assert len({st.problem, sc.problem, sb.problem}) == 3       # separate database records
    compiled = []
    monkeypatch.setattr("stofc.tune.runner_attention.compile_kernel",
                        lambda spec, arch: compiled.append(spec))
    for space in (st, sc, sb):
        compile_attention(space.payload, space.default_config().key)
    assert [(s.has_bias, s.has_softcap) for s in compiled] == [(True, False), (False, True),
                                                               (False, False)]
