"""The frontend's RoPE recognition (stofc/frontend/rope_fuse.py) on hand-built layers.

Recognised, run as one ai.stofc Rotary and matching the original in ONNX Runtime:
rotate-half, interleaved (GPT-J), partial rotary, grouped-query heads behind an exported
repeat_kv, and ONNX Runtime's ``com.microsoft`` ``RotaryEmbedding`` (position ids, half-width
cache), whose package is also run with shifted position ids. Refused with a one-line reason
(the rotation then stays with ONNX Runtime, and the package still matches): only Q rotated,
tables that differ per head, K reading other tables than Q, rotate-half's halves split off
centre (a probe of the model's own nodes differs from what Rotary computes), a contrib op
with ``scale``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from stofc.frontend import load_model
from stofc.package.load import CPU_EP, load
from stofc.pipeline import Instruments, compile_model
from tests.unit.rope_graphs import RopeCase, rope_layer

L_MAX = 32


def _compare(tmp_path, case: RopeCase, feeds=None) -> float:
    """Compile ``case``'s layer and return the package's relative error against it."""
    model = rope_layer(case, tmp_path / "m.onnx")
    pkg = compile_model(model, "model", max_seq_len=L_MAX, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    rng = np.random.default_rng(3)
    feeds = feeds or {"x": rng.standard_normal((2, L_MAX, case.heads * case.head_dim))
                      .astype(np.float32)}
    if case.contrib and "position_ids" not in feeds:
        feeds["position_ids"] = np.broadcast_to(np.arange(L_MAX), (2, L_MAX)).copy()
    so = ort.SessionOptions()
    so.log_severity_level = 4
    (want,) = ort.InferenceSession(str(model), so, providers=[CPU_EP]).run(None, feeds)
    (got,) = load(pkg, providers=[CPU_EP]).run(None, feeds)
    ops = [n.op_type for n in onnx.load(str(pkg / "model.onnx")).graph.node]
    _compare.ops = ops  # type: ignore[attr-defined]
    return float(np.abs(got - want).max() / np.abs(want).max())


FUSED = [
    (RopeCase(), "rotate_half", 32),
    (RopeCase(form="interleaved"), "interleaved", 32),
    (RopeCase(rotary_dim=16), "rotate_half", 16),
    (RopeCase(form="interleaved", rotary_dim=8, heads=4, kv_heads=2), "interleaved", 8),
    (RopeCase(heads=4, kv_heads=1), "rotate_half", 32),
]


@pytest.mark.parametrize("case,form,rd", FUSED, ids=["rotate_half", "interleaved", "partial",
                                                     "interleaved-partial-gqa", "gqa"])
def test_decomposed_rope_runs_as_rotary(tmp_path, case, form, rd):
    graph = load_model(rope_layer(case, tmp_path / "m.onnx"))
    (a,) = graph.attention
    f = a.rope_fusion
    assert f is not None, a.rope_refusal
    assert (f.form, f.rotary_dim, f.tables, f.packed) == (form, rd, "computed", False)
    assert [s.layout for s in f.sources] == ["bsf"] * 3
    assert not [u for u in graph.unsupported if "RoPE" in u.reason]
    assert _compare(tmp_path, case) <= 1e-2
    ops = _compare.ops  # type: ignore[attr-defined]
    assert ops.count("Rotary") == 1 and "Neg" not in ops


@pytest.mark.parametrize("case", [RopeCase(contrib=True),
                                  RopeCase(contrib=True, form="interleaved", rotary_dim=16)],
                         ids=["rotate_half", "interleaved-partial"])
def test_onnx_runtime_rotary_embedding_runs_as_rotary(tmp_path, case):
    graph = load_model(rope_layer(case, tmp_path / "m.onnx"))
    (a,) = graph.attention
    f = a.rope_fusion
    assert f is not None, a.rope_refusal
    assert (f.tables, f.position_ids, f.rotary_dim) == ("contrib", "position_ids",
                                                        case.rotary_dim)
    assert [s.layout for s in f.sources] == ["bsf"] * 3
    rng = np.random.default_rng(5)
    shifted = {"x": rng.standard_normal((2, L_MAX, case.heads * case.head_dim))
               .astype(np.float32),
               "position_ids": rng.integers(0, 200, (2, L_MAX)).astype(np.int64)}
    assert _compare(tmp_path, case, shifted) <= 1e-2   # positions 0..199 of the cache
    ops = _compare.ops  # type: ignore[attr-defined]
    assert ops.count("Rotary") == 1 and "RotaryEmbedding" not in ops


REFUSED = [
    (RopeCase(q_only=True), "only Q is rotated: Rotary rotates both"),
    (RopeCase(per_head_tables=True), "differs per head"),
    (RopeCase(k_tables_scaled=True), "Q and K read different cos/sin tables"),
    (RopeCase(slice_off=2), "the rotation of Q is not what Rotary computes (rotate-half, "
                            "rotary_dim 32, 2 heads: a probe of the model's subgraph differs)"),
    (RopeCase(contrib=True, contrib_scale=2.0), "RotaryEmbedding with scale != 1"),
]


@pytest.mark.parametrize("case,reason", REFUSED, ids=["q-only", "per-head", "k-tables",
                                                      "off-centre", "contrib-scale"])
def test_what_rotary_does_not_compute_stays_with_onnx_runtime(tmp_path, case, reason):
    graph = load_model(rope_layer(case, tmp_path / "m.onnx"))
    (a,) = graph.attention
    assert a.rope_fusion is None and reason in a.rope_refusal, a.rope_refusal
    (stop,) = [u for u in graph.unsupported if "RoPE" in u.reason]
    assert stop.reason.endswith(f"({a.rope_refusal})") and "left to ONNX Runtime" in stop.reason
    assert "\n" not in stop.reason
    if not case.contrib or case.contrib_scale == 1.0:   # ORT rejects a scaled contrib op
        assert _compare(tmp_path, case) <= 1e-2
        assert "Rotary" not in _compare.ops  # type: ignore[attr-defined]


def test_inspect_says_who_runs_the_rope(tmp_path):
    """``stofc inspect``: a RoPE stofc runs is described (form, width, tables, sources) and
    not listed as left to ONNX Runtime; a refused one is, with the reason."""
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from stofc.cli import main

    def inspect(path: Path) -> dict:
        result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "modernbert_ts_op17.onnx"
    data = inspect(fixture)
    assert not [u for u in data["unsupported"] if "RoPE" in u["reason"]]
    for a in data["attention"]:
        f = a["rope_fusion"]
        assert (f["form"], f["rotary_dim"], f["tables"]) == ("rotate_half", 32, "computed")
        assert [s[1] for s in f["sources"]] == ["packed"] and a["rope_refusal"] == ""
    wide = {"COLUMNS": "400"}    # one line per table row
    text = CliRunner().invoke(main, ["inspect", str(fixture)], env=wide).output
    assert "rotate_half 32d (Rotary)" in text
    path = rope_layer(RopeCase(per_head_tables=True), tmp_path / "m.onnx")
    refused = inspect(path)
    (a,) = refused["attention"]
    assert a["rope_fusion"] is None and "differs per head" in a["rope_refusal"]
    assert [u for u in refused["unsupported"] if a["rope_refusal"] in u["reason"]]
    text = CliRunner().invoke(main, ["inspect", str(path)], env=wide).output
    assert "rotate_half 32d (ONNX Runtime)" in text and "differs per head" in text
