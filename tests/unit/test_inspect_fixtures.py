"""``stofc inspect`` on every committed exporter fixture (tests/fixtures/MANIFEST.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from stofc.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
ALL = {e["file"]: e for e in MANIFEST["fixtures"]}
CLASSIC_ARCHS = {"bert", "roberta", "distilbert", "electra", "gpt2", "vit", "t5"}
# the classic architectures from the torch exporters; the issue-15 ones (and every Optimum
# export) are checked by tests/unit/test_modern_models.py
ENTRIES = {f: e for f, e in ALL.items()
           if e["arch"] in CLASSIC_ARCHS and e["exporter"] in ("ts", "dynamo")}

PRE_LN = {"gpt2", "vit", "t5"}
NO_BIAS = {"t5"}


def _inspect(*args: str) -> dict:
    result = CliRunner().invoke(main, ["inspect", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _expected_kinds(arch: str, packed: bool) -> list[str]:
    norm = "rmsnorm" if arch == "t5" else "layernorm"
    bias = [] if arch in NO_BIAS else ["bias_add"]
    proj = ["gemm", *bias] if packed else ["gemm", *bias] * 3
    act = "activation" if arch == "t5" else "gelu"
    body = [*proj, "attention", "gemm", *bias, "residual_add", norm, "gemm", *bias, act,
            "gemm", *bias, "residual_add"]
    return [norm, *body] if arch in PRE_LN else [*body, norm]


def test_manifest_lists_every_committed_fixture():
    on_disk = {p.name for p in FIXTURES.glob("*.onnx")}
    assert on_disk == set(ALL)
    archs = {e["arch"] for e in ALL.values()}
    modern = {"llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3", "modernbert", "gptneo",
              "opt", "clip"}
    assert archs == CLASSIC_ARCHS | modern
    for arch in archs:  # both torch exporters, for every architecture
        assert {"ts", "dynamo"} <= {e["exporter"] for e in ALL.values() if e["arch"] == arch}
    optimum = {e["arch"] for e in ALL.values() if e["exporter"] == "optimum"}
    assert optimum == modern | {"bert", "distilbert"}


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_one_attention_block_per_layer(name):
    entry = ENTRIES[name]
    data = _inspect(str(FIXTURES / name))
    attention = data["attention"]
    assert len(attention) == entry["num_layers"]
    assert [a["layer"] for a in attention] == list(range(entry["num_layers"]))
    for a in attention:
        assert (a["num_heads"], a["head_dim"], a["hidden_size"]) == (
            entry["num_heads"], entry["head_dim"], entry["hidden_size"])
        assert a["nodes"] and a["scale"] == pytest.approx(
            1.0 if entry["arch"] == "t5" else entry["head_dim"] ** -0.5, rel=1e-5)
        assert a["causal_in_graph"] == (entry["arch"] == "gpt2")
        assert a["mask_source"] == (None if entry["arch"] == "vit" else "attention_mask")
        assert a["packed_qkv"] == (entry["arch"] == "gpt2")
    assert data["unsupported"] == []
    assert data["opset"] == entry["opset"]
    for layer in data["layers"]:
        kinds = [op["kind"] for op in layer["chain"]]
        assert kinds == _expected_kinds(entry["arch"], entry["arch"] == "gpt2")
        assert layer["norm_order"] == ("pre" if entry["arch"] in PRE_LN else "post")
    if entry["arch"] == "t5":
        assert {a["mask_form"] for a in attention} == {"relative_bias+additive"}
    segs = data["segments"]
    assert [s["layer"] for s in segs] == list(range(entry["num_layers"]))
    for seg, layer in zip(segs, data["layers"], strict=True):
        assert seg["error"] is None
        flat = [i for s in seg["segments"] for i in s["ops"]]
        assert flat == list(range(len(layer["chain"]))) == list(range(len(seg["scheme"])))
        attention = [s for s in seg["segments"] if s["family"] == "attention"]
        assert len(attention) == 1 and len(attention[0]["ops"]) == 1
        assert {s["family"] for s in seg["segments"]} <= {
            "attention", "gemm", "gemm_norm", "gemm_gemm", "add_norm"}


def test_opset23_dynamo_export_uses_onnx_attention():
    data = _inspect(str(FIXTURES / "bert_dynamo_op23.onnx"))
    assert {a["scale_form"] for a in data["attention"]} == {"onnx_attention"}


def test_eager_exports_scale_the_scores():
    for name in ("bert_ts_op17_eager.onnx", "gpt2_ts_op17_eager.onnx"):
        data = _inspect(str(FIXTURES / name))
        assert {a["scale_form"] for a in data["attention"]} <= {"mul_scores", "div_scores"}


def _family_of(seg: dict, chain: list[dict], kind: str, role: str = "") -> str:
    """The family of the segment holding the first chain op of ``kind`` (and ``role``)."""
    index = next(op["index"] for op in chain if op["kind"] == kind and op["role"] == role)
    return next(s["family"] for s in seg["segments"] if index in s["ops"])


def test_segments_are_the_plans_starting_scheme():
    bert = _inspect(str(FIXTURES / "bert_ts_op17.onnx"))
    seg, chain = bert["segments"][0], bert["layers"][0]["chain"]
    assert [s["name"] for s in seg["segments"][:4]] == ["gemm(q)", "gemm(k)", "gemm(v)",
                                                         "attention"]
    assert bert["segments_source"].startswith("stofc.plan.build_plan")
    # 512 tokens cannot fill a GPU with full-row norm tiles: the norm runs as Add+Norm
    assert _family_of(seg, chain, "layernorm") == "add_norm"
    # 16 x 2048 tokens can: the out projection absorbs its residual and LayerNorm
    big = _inspect(str(FIXTURES / "bert_ts_op17.onnx"), "--batch", "16", "--seq-len", "2048")
    assert _family_of(big["segments"][0], chain, "gemm", "out") == "gemm_norm"
    assert big["segments"][0]["scheme"] != seg["scheme"]


def test_pre_ln_segments_start_with_the_norm():
    gpt2 = _inspect(str(FIXTURES / "gpt2_dynamo_op18.onnx"))
    seg, chain = gpt2["segments"][0], gpt2["layers"][0]["chain"]
    assert chain[0]["kind"] == "layernorm" and seg["segments"][0]["ops"][0] == 0
    assert seg["segments"][0]["family"] == "add_norm"
    assert _family_of(seg, chain, "gemm", "qkv") == "gemm"


def test_mask_option_reports_the_selector_choice():
    data = _inspect(str(FIXTURES / "distilbert_ts_op17.onnx"), "--mask", "causal")
    assert data["mask"]["kernel"] in ("block", "row") and data["mask"]["why"]
    unsupported = _inspect(str(FIXTURES / "bert_ts_op17.onnx"), "--mask", "causal")  # D=16
    assert unsupported["mask"]["kernel"] is None
    assert "head_dim 16" in unsupported["mask"]["why"]


def test_json_keys_are_stable():
    data = _inspect(str(FIXTURES / "vit_dynamo_op20.onnx"))
    assert {"model", "opset", "attention", "layers", "segments", "unsupported",
            "left_to_ort", "inputs", "outputs", "padding_mask_input", "mask"} <= set(data)
    assert {"layer", "num_heads", "head_dim", "hidden_size", "nodes", "scale", "scale_form",
            "mask_form", "mask_source", "bias_input", "softmax_guarded",
            "causal_in_graph"} <= set(data["attention"][0])
    names = {n for layer in data["layers"] for op in layer["chain"] for n in op["nodes"]}
    assert not names & set(data["left_to_ort"])


def test_human_output_and_mask_option():
    result = CliRunner().invoke(main, ["inspect", str(FIXTURES / "bert_ts_op17.onnx"),
                                       "--mask", "sliding:window=16"])
    assert result.exit_code == 0, result.output
    for text in ("Attention blocks", "Layer 0 chain", "Layer 1 chain", "segments:",
                 "left to ONNX Runtime", "sliding:window=16"):
        assert text in result.stdout
    data = _inspect(str(FIXTURES / "bert_ts_op17.onnx"), "--mask", "sliding:window=16")
    assert data["mask"]["spec"] == "sliding:window=16" and data["mask"]["seq_len"] == 512
    # |i - j| <= 16 at L = 512: a band of 33 minus the corners
    band = sum(min(i + 16, 511) - max(i - 16, 0) + 1 for i in range(512)) / 512**2
    assert data["mask"]["density"] == pytest.approx(band, rel=1e-6)
