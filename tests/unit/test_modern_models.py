"""Issue 15 acceptance on the CPU EP: the models people deploy today compile with their own
mask and the package matches the *bare original* in ONNX Runtime.

For every issue-15 fixture (both torch exporters and Optimum; ``tests/fixtures/MANIFEST.json``)
``stofc compile`` runs with the default ``--mask model`` at a small L_max (windows of 16 are
shorter than it), then the package and the original file run on the same right-padded batch
(batch 2, the second sequence shorter) and the relative error on real tokens must be <= 1e-2.

Grouped-query attention (``kv_num_heads``) and soft-capping (``softcap``) run through the
SparseAttention CPU twin's attributes (a5afc9b): Llama, Mistral, Qwen2, Phi-3 and Gemma are
checked like the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from stofc.errors import ModelError
from stofc.frontend import load_model
from stofc.frontend.types import OpKind
from stofc.masks import to_dense
from stofc.package.load import CPU_EP, load, read_plan_document
from stofc.package.verify import compare, make_inputs, verify_package
from stofc.pipeline import Instruments, compile_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
MODERN = ("llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3", "modernbert", "gptneo", "opt",
          "clip")
CASES = sorted(e["file"] for e in MANIFEST["fixtures"]
               if e["arch"] in MODERN or e["exporter"] == "optimum")
L_MAX = 64
BOUND = 1e-2


def _package(name: str, tmp: Path, mask: str = "model") -> Path:
    return compile_model(FIXTURES / name, mask, max_seq_len=L_MAX, out_dir=tmp / "pkg",
                         instruments=Instruments(progress=False))


def _bare_error(package: Path, name: str) -> float:
    """Relative error of the package against the bare original file, right-padded batch."""
    graph = load_model(FIXTURES / name)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    bare = ort.InferenceSession(str(FIXTURES / name), so, providers=[CPU_EP])
    pkg = load(package, providers=[CPU_EP],
               session_options_hook=lambda o: setattr(o, "log_severity_level", 4))
    feeds, real = make_inputs(graph, 2, L_MAX, np.random.default_rng(0))
    assert not real.all() or graph.padding_mask_input is None  # the batch is right-padded
    names = [o.name for o in bare.get_outputs()]
    worst = 0.0
    for want, got in zip(bare.run(names, feeds), pkg.run(names, feeds), strict=True):
        max_abs, max_ref, _ = compare(got, want, real)
        worst = max(worst, max_abs / max(max_ref, 1e-30))
    return worst


@pytest.mark.parametrize("name", CASES)
def test_compiles_with_its_own_mask_and_matches_the_original(name, tmp_path):
    package = _package(name, tmp_path)
    assert _bare_error(package, name) <= BOUND


def _format(package: Path, layer: int):
    return read_plan_document(package).masks()[layer]


def test_gptneo_local_window_survives_a_user_mask(tmp_path):
    """The old miscompile: --mask causal dropped GPT-Neo's local window (0.12-0.69 off).
    Now the user's mask is ANDed: a wider user band keeps the model's window of 15."""
    name = "gptneo_ts_op17_eager.onnx"
    package = _package(name, tmp_path, "sliding:window=40,causal=true")
    q = np.arange(L_MAX)
    d = q[:, None] - q[None, :]
    assert np.array_equal(to_dense(_format(package, 1)), (d >= 0) & (d <= 15))  # local layer
    assert np.array_equal(to_dense(_format(package, 0)), (d >= 0) & (d <= 40))  # global layer
    report = verify_package(package, cases=[(2, L_MAX)])   # original AND the user's mask
    assert report.passed and report.worst.mask_effect > 0


@pytest.mark.parametrize("name", ["gptneo_ts_op17_eager.onnx", "modernbert_dynamo_op18.onnx",
                                  "mistral_ts_op17.onnx", "gemma3_dynamo_op18.onnx"])
def test_sliding_window_models_and_a_user_mask(name, tmp_path):
    """A structured mask that removes keys the model's window allowed: window 4 inside the
    model's 15/16. Every layer's format is the AND; the package matches the original with
    that mask injected (``stofc verify``), and the mask does change the function."""
    graph = load_model(FIXTURES / name)
    package = _package(name, tmp_path, "sliding:window=4")
    q = np.arange(L_MAX)
    d = q[:, None] - q[None, :]
    for layer in graph.layers:
        dense = to_dense(_format(package, layer.index))
        assert not dense[np.abs(d) > 4].any()          # the user's band removes keys
        assert dense[d == 0].all()
    report = verify_package(package, cases=[(2, L_MAX)])
    assert report.passed and report.worst.mask_effect > BOUND


def test_inspect_reports_each_layers_own_mask():
    from stofc.frontend.model_mask import model_masks

    texts = {
        "modernbert_ts_op17.onnx": ["none (dense)", "sliding window 16 (both sides: |q-k| <= 16)",
                                    "sliding window 16 (both sides: |q-k| <= 16)"],
        "gptneo_dynamo_op18_eager.onnx": ["causal", "sliding window 15 (causal: 0 <= q-k <= 15)"],
        "gemma2_ts_op17_eager.onnx": ["sliding window 15 (causal: 0 <= q-k <= 15)", "causal"],
        "mistral_optimum_op18.onnx": ["sliding window 15 (causal: 0 <= q-k <= 15)"] * 2,
        "llama_dynamo_op18.onnx": ["causal", "causal"],
        "bert_optimum_op18.onnx": ["none (dense)", "none (dense)"],
    }
    for name, want in texts.items():
        masks = model_masks(load_model(FIXTURES / name))
        assert [m.description for m in masks.layers] == want, name
        assert all(max(m.probes) > 2 * 16 for m in masks.layers if m.probes), name


def test_gemma2_soft_capping_and_gqa_are_recognised():
    graph = load_model(FIXTURES / "gemma2_dynamo_op18_eager.onnx")
    for a in graph.attention:
        assert a.softcap == 50.0 and a.num_heads == 4 and a.kv_heads == 2
        assert abs(a.scale - 24 ** -0.5) < 1e-6           # query_pre_attn_scalar = 24
        assert a.q_layout == a.k_layout == "bhsd" and a.rope and a.kv_expanded


def test_partial_rotary_and_packed_projection():
    graph = load_model(FIXTURES / "phi3_ts_op17.onnx")
    for a in graph.attention:
        assert (a.num_heads, a.kv_heads, a.head_dim) == (2, 1, 32)
        assert all(r.rotary_dim == 16 for r in a.rope)     # partial_rotary_factor 0.5
    graph = load_model(FIXTURES / "modernbert_ts_op17.onnx")  # Wqkv with a -1 head count
    assert all((a.num_heads, a.kv_heads) == (2, 2) for a in graph.attention)


def test_a_mask_the_model_computes_per_length_otherwise_is_refused(tmp_path):
    """A model mask that is not the top-left corner of a longer one is an error naming the
    layer (here: a bottom-right aligned band, built by hand)."""
    from onnx import helper

    from stofc.frontend.model_mask import model_masks

    # scores + where(k - q >= S - 3, 0, -inf): depends on S, not only on q - k
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], start=1, end=2),
        helper.make_node("Squeeze", ["shp"], ["s"]),
        helper.make_node("Range", ["zero", "s", "one"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "ax1"], ["rq"]),
        helper.make_node("Unsqueeze", ["r", "ax0"], ["rk"]),
        helper.make_node("Sub", ["rk", "rq"], ["kq"]),
        helper.make_node("Sub", ["s", "three"], ["lim"]),
        helper.make_node("GreaterOrEqual", ["kq", "lim"], ["far"]),
        helper.make_node("Where", ["far", "zf", "ninf"], ["bias"]),
    ]
    graph = _attention_with_bias(nodes, tmp_path)
    with pytest.raises(ModelError, match="layer 0: the mask the model computes at length"):
        model_masks(graph)


def _attention_with_bias(bias_nodes, tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    h, d = 2, 32
    inits = [numpy_helper.from_array(rng.standard_normal((h * d, h * d)).astype(np.float32), n)
             for n in ("wq", "wk", "wv")]
    inits += [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in (
        ("zero", 0, np.int64), ("one", 1, np.int64), ("three", 3, np.int64),
        ("ax0", [0], np.int64), ("ax1", [1], np.int64), ("zf", 0.0, np.float32),
        ("ninf", -np.inf, np.float32), ("split", [0, 0, h, d], np.int64),
        ("merge", [0, 0, h * d], np.int64), ("scale", 1 / np.sqrt(d), np.float32))]
    nodes = list(bias_nodes)
    for n in ("q", "k", "v"):
        nodes += [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}p"]),
                  helper.make_node("Reshape", [f"{n}p", "split"], [f"{n}s"]),
                  helper.make_node("Transpose", [f"{n}s"], [f"{n}h"],
                                   perm=[0, 2, 3, 1] if n == "k" else [0, 2, 1, 3])]
    nodes += [helper.make_node("MatMul", ["qh", "kh"], ["qk"]),
              helper.make_node("Mul", ["qk", "scale"], ["sc"]),
              helper.make_node("Add", ["sc", "bias"], ["sb"]),
              helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merge"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", h * d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", h * d])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return load_model(path)


@pytest.mark.parametrize("name", ["llama_ts_op17.onnx", "llama_dynamo_op18.onnx",
                                  "mistral_optimum_op18.onnx", "qwen2_dynamo_op18.onnx"])
def test_rope_models_fuse_the_lead_rmsnorm_and_the_projections(name, tmp_path):
    """RoPE does not stop the chain at the attention: the Q/K projections are found
    behind the rotation (stofc's Rotary op), so the pre-norm stream's lead RMSNorm and the
    Q/K/V GEMMs are stofc segments, and the package still matches."""
    graph = load_model(FIXTURES / name)
    for layer in graph.layers:
        assert layer.chain[0].kind == OpKind.RMSNORM, name
        gemms = [o.role for o in layer.chain if o.kind == OpKind.GEMM]
        assert gemms[:3] == ["q", "k", "v"], name
    package = _package(name, tmp_path)
    plan = read_plan_document(package).plan
    for lp in plan.layers:
        lead = next(s for s in lp.segments if 0 in s.ops)
        assert lead.family in ("add_norm", "gemm_norm")
        assert lead.epilogues[-1].norm == "rmsnorm"
        roles = {r for s in lp.segments for r in s.roles}
        assert {"q", "k", "v", "out"} <= roles
    assert _bare_error(package, name) <= BOUND


@pytest.mark.parametrize("name", ["gemma2_ts_op17_eager.onnx", "gemma2_dynamo_op18_eager.onnx",
                                  "gemma3_optimum_op18.onnx"])
def test_gemma_sandwich_norms_are_fused(name, tmp_path):
    """Gemma's post-attention RMSNorm sits between the output projection and the residual
    Add (sandwich order). It is a chain operator now: gemm(out) | rmsnorm | residual Add +
    pre-FFN RMSNorm in one memory pass."""
    graph = load_model(FIXTURES / name)
    for layer in graph.layers:
        kinds = [o.kind for o in layer.chain]
        at = kinds.index(OpKind.RESIDUAL_ADD)
        assert kinds[at - 2:at + 2] == [OpKind.GEMM, OpKind.RMSNORM, OpKind.RESIDUAL_ADD,
                                        OpKind.RMSNORM], name
    package = _package(name, tmp_path)
    for lp in read_plan_document(package).plan.layers:
        fused = [s for s in lp.segments if s.family == "add_norm" and s.epilogues[-1].residual
                 and s.epilogues[-1].norm != "none"]
        assert len(fused) == 1, name
        assert fused[0].epilogues[-1].norm == "rmsnorm"
    assert _bare_error(package, name) <= BOUND


GATED_ARCHS = ("llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3", "modernbert")
GATED_CASES = sorted(e["file"] for e in MANIFEST["fixtures"] if e["arch"] in GATED_ARCHS)
PACKED_QKV = ("phi3", "modernbert")     # one Wqkv / qkv_proj projection behind RoPE


@pytest.mark.parametrize("name", GATED_CASES)
def test_gated_ffn_and_packed_qkv_are_stofc_segments(name, tmp_path):
    """Issue 15, modern layer bodies: the gated FFN (SwiGLU, GeGLU erf/tanh; separate gate
    and up projections packed at load, or one packed projection split in halves) is one
    gemm_glu segment per layer, written as one GatedGemm; ModernBERT's and Phi-3's packed
    Q|K|V projection behind RoPE is a GEMM segment (its split and the rotation are the
    Rotary op's); nothing of the FFN is left to ONNX Runtime; the package matches the
    bare original within 1e-2."""
    arch = next(e["arch"] for e in MANIFEST["fixtures"] if e["file"] == name)
    graph = load_model(FIXTURES / name)
    assert not [u for u in graph.unsupported if "FFN" in u.reason or "residual" in u.reason]
    left = set(graph.left_to_ort)
    for layer in graph.layers:
        kinds = [o.kind for o in layer.chain]
        at = kinds.index(OpKind.GATED)
        assert layer.chain[at - 1].role == "ffn_in" and layer.chain[at + 1].role == "ffn_out"
        assert kinds[-1] == OpKind.RESIDUAL_ADD and layer.norm_order == "pre"
        assert not {n for o in layer.chain[at - 1:] for n in o.nodes} & left
        if arch in PACKED_QKV:
            (qkv,) = [o for o in layer.chain if o.role == "qkv"]
            width = (layer.attention.num_heads + 2 * layer.attention.kv_heads) * \
                layer.attention.head_dim
            assert qkv.param("out_features") == width and not set(qkv.nodes) & left
    if arch in PACKED_QKV:
        assert not [u for u in graph.unsupported if u.op_type == "RoPE"]
        assert all(a.rope_fusion is not None and a.rope_fusion.packed for a in graph.attention)
    package = _package(name, tmp_path)
    plan = read_plan_document(package).plan
    for lp in plan.layers:
        (glu,) = [s for s in lp.segments if s.family == "gemm_glu"]
        assert glu.kernel.template == "vendor/cublas" and glu.roles == ("ffn_in",)
        if arch in PACKED_QKV:
            assert any(s.family == "gemm" and s.roles == ("qkv",) for s in lp.segments)
    model = onnx.load(str(package / "model.onnx"))
    assert sum(n.op_type == "GatedGemm" for n in model.graph.node) == len(graph.layers)
    assert _bare_error(package, name) <= BOUND


ROPE_ARCHS = ("llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3", "modernbert")
ROPE_CASES = sorted(e["file"] for e in MANIFEST["fixtures"] if e["arch"] in ROPE_ARCHS)
# (form, rotary_dim, how the op reads Q, K, V): one packed projection (ModernBERT's Wqkv,
# Phi-3's qkv_proj, partial rotary), the three projections, or Gemma 3's Q/K after its
# per-head norm (4-D, [B, H, S, D])
ROPE_SHAPES = {"llama": ("rotate_half", 32, ("bsf", "bsf", "bsf")),
               "mistral": ("rotate_half", 32, ("bsf", "bsf", "bsf")),
               "qwen2": ("rotate_half", 32, ("bsf", "bsf", "bsf")),
               "gemma2": ("rotate_half", 32, ("bsf", "bsf", "bsf")),
               "gemma3": ("rotate_half", 32, ("bhsd", "bhsd", "bsf")),
               "phi3": ("rotate_half", 16, ("packed",)),
               "modernbert": ("rotate_half", 32, ("packed",))}


@pytest.mark.parametrize("name", ROPE_CASES)
def test_rope_leaves_onnx_runtime(name, tmp_path):
    """Issue 15, item 1: every RoPE fixture's rotation is recognised exactly (form,
    rotary_dim, the tables it reads, the values the op reads) and runs as one ai.stofc
    Rotary per layer: no RoPE is reported left to ONNX Runtime, none of the rotation's
    nodes (nor the head splits and the packed projection's split in front of it) is in
    the package, SparseAttention reads Rotary's packed [Q' | K' | V], and the package
    matches the bare original."""
    arch = next(e["arch"] for e in MANIFEST["fixtures"] if e["file"] == name)
    form, rd, layouts = ROPE_SHAPES[arch]
    graph = load_model(FIXTURES / name)
    assert not [u for u in graph.unsupported if u.op_type == "RoPE" or "RoPE" in u.reason]
    left = set(graph.left_to_ort)
    rope_nodes = set()
    for a in graph.attention:
        f = a.rope_fusion
        assert f is not None and a.rope_refusal == "", (name, a.layer, a.rope_refusal)
        assert (f.form, f.rotary_dim, tuple(s.layout for s in f.sources)) == (form, rd, layouts)
        assert f.tables == "computed" and f.position_ids is None
        rotation = {n for r in a.rope for n in r.nodes}
        assert rotation <= set(f.nodes) and not set(f.nodes) & left
        rope_nodes |= set(f.nodes)
    package = _package(name, tmp_path)
    model = onnx.load(str(package / "model.onnx"))
    assert not rope_nodes & {n.name for n in model.graph.node}
    rotary = [n for n in model.graph.node if n.op_type == "Rotary"]
    assert len(rotary) == len(graph.layers)
    outs = {n.output[0] for n in rotary}
    for sa in (n for n in model.graph.node if n.op_type == "SparseAttention"):
        assert sa.input[0] in outs and list(sa.input[1:3]) == ["", ""]
    assert not [n for n in model.graph.node if n.op_type == "Neg"]   # no rotate_half left
    producer = {o: n for n in model.graph.node for o in n.output}
    if layouts != ("bhsd", "bhsd", "bsf"):   # one packed projection feeds Rotary directly
        for n in rotary:
            assert producer[n.input[0]].op_type == "FusedGemm" and n.input[1:3] == ["", ""]
    assert _bare_error(package, name) <= BOUND
