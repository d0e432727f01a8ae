"""The model's own mask at long compiled lengths: read at short probes, never at L x L.

:func:`~stofc.frontend.model_mask.model_masks` fits MASKS.md families at short probe
lengths (at least one longer than any window found) and writes the family for
``max_seq_len``; only a mask no family fits (``bitmap``) is evaluated at
``max_seq_len``, and only within :data:`~stofc.masks.limits.MAX_PROBE_BYTES`.
Every test records the lengths the mask subgraph was evaluated at.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from stofc.errors import LimitError
from stofc.frontend import model_mask
from stofc.frontend.model_mask import model_masks
from stofc.masks.build import build_predicate
from tests.unit.test_modern_models import FIXTURES, _attention_with_bias, load_model

L_LONG = 32768


@pytest.fixture
def evaluated(monkeypatch):
    """The lengths the mask subgraph is evaluated at, in order."""
    seen: list[int] = []
    real = model_mask._evaluate

    def record(session, inputs, values, s):
        seen.append(s)
        return real(session, inputs, values, s)

    monkeypatch.setattr(model_mask, "_evaluate", record)
    return seen


def _const(name, value):
    return helper.make_node("Constant", [], [name],
                            value=numpy_helper.from_array(np.array(value, np.int64)))


def _mask_graph(tmp_path, allowed_nodes):
    """Scores + where(allowed, 0, -inf), ``allowed`` computed from q (``rq``) and k (``rk``)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], start=1, end=2),
        helper.make_node("Squeeze", ["shp"], ["s"]),
        helper.make_node("Range", ["zero", "s", "one"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "ax1"], ["rq"]),
        helper.make_node("Unsqueeze", ["r", "ax0"], ["rk"]),
        *allowed_nodes,
        helper.make_node("Where", ["allowed", "zf", "ninf"], ["bias"]),
    ]
    return _attention_with_bias(nodes, tmp_path)


def _band(width_nodes):
    """0 <= q - k <= w, with ``w`` made by ``width_nodes`` (causal, so that the frontend's
    length-8 probe sees a mask at all)."""
    return [helper.make_node("Sub", ["rq", "rk"], ["dqk"]),
            helper.make_node("GreaterOrEqual", ["dqk", "zero"], ["past"]),
            *width_nodes,
            helper.make_node("LessOrEqual", ["dqk", "w"], ["near"]),
            helper.make_node("And", ["past", "near"], ["allowed"])]


def test_a_band_is_read_at_short_probes_and_written_for_32k(tmp_path, evaluated):
    graph = _mask_graph(tmp_path, _band([_const("w", 16)]))
    mask = model_masks(graph, L_LONG).layers[0]
    assert mask.description == "sliding window 16 (causal: 0 <= q-k <= 16)"
    assert max(evaluated) < 100 and max(mask.probes) > 2 * 16   # longer than the window
    assert sorted(set(evaluated)) == sorted(evaluated)           # each length once
    pred = build_predicate(mask.node, L_LONG, 64)
    q = np.array([0, 100, L_LONG - 1])
    assert pred.allowed(q[1:], q[1:] - 16).all() and not pred.allowed(q[1:], q[1:] - 17).any()
    assert not pred.allowed(q[:2], q[:2] + 1).any()


def test_a_window_the_constants_hide_gets_a_longer_probe(tmp_path, evaluated):
    """w = 25 + 25: the constant scan sees 25 (probe 97); the fit at 97 finds the window
    50 and probes 2 * 50 + 3 = 103 > 97 before it trusts the band."""
    nodes = [_const("half", 25), helper.make_node("Add", ["half", "half"], ["w"])]
    mask = model_masks(_mask_graph(tmp_path, _band(nodes)), L_LONG).layers[0]
    assert mask.description == "sliding window 50 (causal: 0 <= q-k <= 50)"
    assert 103 in evaluated and max(evaluated) == 103


def test_chunks_get_a_layout_for_the_compiled_length(tmp_path, evaluated):
    nodes = [_const("c", 3),
             helper.make_node("Div", ["rq", "c"], ["bq"]),
             helper.make_node("Div", ["rk", "c"], ["bk"]),
             helper.make_node("Equal", ["bq", "bk"], ["same"]),
             helper.make_node("LessOrEqual", ["rk", "rq"], ["past"]),
             helper.make_node("And", ["same", "past"], ["allowed"])]
    mask = model_masks(_mask_graph(tmp_path, nodes), 4096).layers[0]
    assert mask.description == "chunked, chunks of 3 (causal)" and max(evaluated) < 100
    layout = dict(mask.node.params)["layout"]
    assert layout.shape == (-(-4096 // 3),) * 2 and layout.data.sum() == layout.shape[0]


def _not_a_family():
    """Every third key, plus the diagonal: no MASKS.md family fits."""
    return [_const("three_", 3), _const("zero_", 0),
            helper.make_node("Mod", ["rk", "three_"], ["m"]),
            helper.make_node("Equal", ["m", "zero_"], ["every3"]),
            helper.make_node("Equal", ["rk", "rq"], ["diag"]),
            helper.make_node("Or", ["every3", "diag"], ["allowed"])]


def test_a_bitmap_is_evaluated_at_the_compiled_length_within_the_budget(tmp_path, evaluated):
    mask = model_masks(_mask_graph(tmp_path, _not_a_family()), 256).layers[0]
    assert mask.kind == "bitmap" and evaluated[-1] == 256 and max(mask.probes) == 256
    data = dict(mask.node.params)["file"].data
    q = np.arange(256)
    assert np.array_equal(data, (q[None, :] % 3 == 0) | (q[:, None] == q[None, :]))


def test_a_bitmap_beyond_the_probe_budget_is_refused_before_it_is_evaluated(tmp_path,
                                                                            evaluated):
    with pytest.raises(LimitError, match=r"above the 4\.0 GiB limit") as err:
        model_masks(_mask_graph(tmp_path, _not_a_family()), L_LONG)
    assert "length 32768" in err.value.message and max(evaluated) < 100
    assert "MAX_PROBE_BYTES" in (err.value.hint or "")


def test_modernbert_at_32k_never_evaluates_long(evaluated):
    masks = model_masks(load_model(FIXTURES / "modernbert_ts_op17.onnx"), L_LONG)
    assert [m.description for m in masks.layers] == [
        "none (dense)", *["sliding window 16 (both sides: |q-k| <= 16)"] * 2]
    assert max(evaluated) <= 97
