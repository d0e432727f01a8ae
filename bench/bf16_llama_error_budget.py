"""Issue 15: where a bf16 package of the Llama-style model loses accuracy, by CPU emulation.

``stofc compile --dtype bf16`` of ``bench/e2e_long_models.py``'s ``llama`` (4 layers, hidden
2048, GQA 16/4 x 128, RoPE, SwiGLU 8192, RMSNorm; seed-0 random weights, TorchScript opset
17) was refused by its own pre-rename check: 1.504e-2 > 1e-2 on the CPU EP at (2, 72).

This script re-implements the exported model in numpy float32 (weights read from the ONNX
file by the exporter's node names: the bench export's ``/m/...`` and the fixtures'
``/model/...``) and rounds to bfloat16 (round to nearest even, as
``stofc.lower.emit.to_tensor``, ``from_float<BFloat16_t>`` and ``__float2bfloat16_rn``)
exactly where a bf16 package stores a value in T. Sites (per layer):

* ``w_attn``: the q/k/v/o projection weights (FusedGemm's ``w``, bf16);
* ``w_mlp``: gate/up/down weights: bf16 only once the gated FFN is fused (today ONNX
  Runtime runs the SwiGLU MLP in float32 from the model's own float32 weights);
* ``embed``: the embedding row, where it starts the residual stream;
* ``norm_in``: what a norm reads, rounded where the stream itself is not (a stream in
  float32 enters a norm as a bf16 Cast or residual: stofc.lower.stream);
* ``norm1_out`` / ``norm2_out``: the RMSNorm outputs (AddLayerNorm's y, a GEMM's x);
* ``qkv_out``: the Q/K/V FusedGemm outputs (RoPE then runs in float32 in ONNX Runtime);
* ``rope_out``: rotated Q and K cast back to T for SparseAttention;
* ``attn_P``: P packed to T before P.V (GPU block-wise kernels only; not on the CPU twin);
* ``attn_out``: SparseAttention's output;
* ``update`` / ``update_mlp``: ``attn @ Wo`` / the down projection's result before the
  residual joins (a GEMM writing its result in T and a norm adding the stream to it in
  float32: a form OPS.md does not have yet, see the rows);
* ``h_attn``: ``x + attn @ Wo``, the mid-layer residual stream (before the fix: the
  FusedGemm with the residual as input 3 wrote it in T, the MLP read it as its residual);
* ``mlp_act``: ``silu(gate) * up`` in T (a fused gated FFN's hidden activation);
* ``h_mlp``: ``h_attn + mlp``, the stream entering the next layer (ONNX Runtime's float32
  Add, which the package Cast to T for the next layer's norm and residual; the last
  layer's stays float32 into ONNX Runtime's final norm); with a fused FFN the down
  projection's FusedGemm writes it.

Rows: ``before`` is what stofc built on 2026-11-25 (the refused package); ``now`` what it
builds since the residual stream is kept float32 (stofc/lower/stream.py: the stream is
rounded nowhere, the norms read it rounded); the floors round only what a tensor-core
GEMM or the attention kernel must read in T (everything else float32): no stofc-side
precision choice of a bf16 package rounds less. GEMMs accumulate in float32, norms and
softmax in float32 (the CPU twins in ``cuda/ort/cpu_ops.cc``). The reference is what
compile's check and ``stofc verify`` run: ONNX Runtime's CPU EP on the original fp32 model
with the mask injected, on ``make_inputs``' feeds (seed 0, batch 2, length 72: the check's
case; seeds 1.. the spread). Metric: verify's ``max |pkg - ref| / max |ref|`` over real
tokens. ``--package DIR`` adds the measured error of compiled packages on the same inputs.

Usage: python bench/bf16_llama_error_budget.py MODEL.onnx [--seeds 8] [--length 72]
       [--package DIR ...] [--sites] [--save-feeds FEEDS.npz]
(MODEL: ``bench/e2e_long_models.py``'s export of ``llama``; the full model takes ~3 GB of
memory and ~1.5 s per emulated run on 2 cores.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SITES = ("w_attn", "w_mlp", "embed", "norm_in", "norm1_out", "qkv_out", "rope_out", "attn_P",
         "attn_out", "update", "h_attn", "norm2_out", "mlp_act", "update_mlp", "h_mlp")
STREAM = frozenset({"embed", "h_attn", "h_mlp"})        # the residual stream
# what the package stored in T before the fix (the MLP is ORT's, float32; CPU attention
# keeps P float32)
BEFORE = frozenset({"w_attn", "embed", "norm1_out", "qkv_out", "rope_out", "attn_out",
                   "h_attn", "norm2_out", "h_mlp"})
# a gated FFN fused as well (the work in progress): its weights, hidden activation in T
FUSED_FFN = BEFORE | {"w_mlp", "mlp_act"}
# torch.autocast(bfloat16)-like: GEMM operands and outputs in bf16, residual stream fp32
AUTOCAST = frozenset(SITES) - STREAM - {"attn_P"}


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


class Llama:
    """The exported LlamaModel's weights and shapes, found by the exporter's node names."""

    def __init__(self, model: onnx.ModelProto) -> None:
        init = {t.name: t for t in model.graph.initializer}
        alias = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Identity"}
        consts = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}

        def array(name: str) -> np.ndarray:
            name = alias.get(name, name)
            if name in init:
                return numpy_helper.to_array(init[name]).astype(np.float32)
            return numpy_helper.to_array(consts[name].attribute[0].t).astype(np.float32)

        # the exporter names nodes by module path: /m/... (bench wrapper), /model/... (fixtures)
        by_name = {n.name.split("/", 2)[-1]: n for n in model.graph.node if n.name.count("/") > 1}
        self.layers = sum(1 for n in by_name if n.endswith("/self_attn/q_proj/MatMul"))
        self.embed = array(by_name["embed_tokens/Gather"].input[0])
        self.w: list[dict[str, np.ndarray]] = []
        for i in range(self.layers):
            p = f"layers.{i}"
            w = {k: array(by_name[f"{p}/{s}/MatMul"].input[1]) for k, s in (
                ("q", "self_attn/q_proj"), ("k", "self_attn/k_proj"), ("v", "self_attn/v_proj"),
                ("o", "self_attn/o_proj"), ("gate", "mlp/gate_proj"), ("up", "mlp/up_proj"),
                ("down", "mlp/down_proj"))}
            for k in ("input_layernorm", "post_attention_layernorm"):
                w[k] = array(by_name[f"{p}/{k}/Mul_1"].input[0])
            self.w.append(w)
        self.norm = array(by_name["norm/Mul_1"].input[0])
        self.eps = float(array(by_name["norm/Add"].input[1]))
        self.inv_freq = array(by_name["rotary_emb/Mul"].input[1]).reshape(-1)
        self.head_dim = 2 * self.inv_freq.size
        self.heads = self.w[0]["q"].shape[1] // self.head_dim
        self.kv_heads = self.w[0]["k"].shape[1] // self.head_dim


def rms_norm(h: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """HF LlamaRMSNorm in float32 (the CPU twin takes the statistics in double)."""
    var = (h.astype(np.float64) ** 2).mean(-1, keepdims=True)
    return (h / np.sqrt(var + eps)).astype(np.float32) * gamma


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rot * sin).astype(np.float32)


def fp16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest float16, returned as float32."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def run(m: Llama, ids: np.ndarray, pad: np.ndarray, rounded: frozenset[str],
        trace: dict[str, list[np.ndarray]] | None = None, half: bool = False) -> np.ndarray:
    """last_hidden_state with the values at the sites in ``rounded`` rounded to bfloat16.

    ``h_mlp`` of the last layer is rounded only when the FFN is fused (``w_mlp`` rounded):
    today the last residual sum is ORT's float32 Add read by ORT's final norm. ``trace``
    collects each site's value per layer (``[B, S, ...]``), to compare with a package's.
    ``half``: round to float16 instead (what an fp16 package of the same form stores).
    """
    to_t = fp16 if half else bf16

    def r(site: str, x: np.ndarray) -> np.ndarray:
        x = to_t(x) if site in rounded else x.astype(np.float32)
        if trace is not None and not site.startswith("w_"):
            trace.setdefault(site, []).append(x)
        return x

    B, S = ids.shape
    H, Hkv, D = m.heads, m.kv_heads, m.head_dim
    ang = np.arange(S, dtype=np.float32)[:, None] * m.inv_freq[None, :]
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang)[None, None], np.sin(ang)[None, None]
    keep = np.tril(np.ones((S, S), bool))[None, None] & pad[:, None, None, :].astype(bool)
    x = r("embed", m.embed[ids])
    for i, w in enumerate(m.w):
        wa = {k: r("w_attn", w[k]) for k in ("q", "k", "v", "o")}
        wm = {k: r("w_mlp", w[k]) for k in ("gate", "up", "down")}
        h = r("norm1_out", rms_norm(r("norm_in", x), w["input_layernorm"], m.eps))
        q, k, v = (r("qkv_out", h @ wa[n]).reshape(B, S, -1, D).transpose(0, 2, 1, 3)
                   for n in ("q", "k", "v"))
        q, k = r("rope_out", rope(q, cos, sin)), r("rope_out", rope(k, cos, sin))
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
        scores = (q @ k.transpose(0, 1, 3, 2)) * np.float32(1 / math.sqrt(D))
        scores = np.where(keep, scores, -np.inf)
        e = np.exp(scores - scores.max(-1, keepdims=True)).astype(np.float32)
        ctx = (r("attn_P", e) @ v) / e.sum(-1, keepdims=True)
        ctx = r("attn_out", ctx.transpose(0, 2, 1, 3).reshape(B, S, H * D))
        x = r("h_attn", x + r("update", ctx @ wa["o"]))
        h = r("norm2_out", rms_norm(r("norm_in", x), w["post_attention_layernorm"], m.eps))
        g = h @ wm["gate"]
        act = r("mlp_act", (g / (1 + np.exp(-g))) * (h @ wm["up"]))
        last = i + 1 == len(m.w)
        x = x + r("update_mlp", act @ wm["down"])
        x = r("h_mlp", x) if not last or "w_mlp" in rounded else x
    return rms_norm(x, m.norm, m.eps)


def rel(out: np.ndarray, ref: np.ndarray, real: np.ndarray) -> float:
    """verify's max |out - ref| / max |ref| over real tokens."""
    d = np.abs(out.astype(np.float64) - ref.astype(np.float64))[real]
    return float(d.max()) / float(np.abs(ref.astype(np.float64))[real].max())


# only what a tensor-core GEMM or the attention kernel reads is in T; all else float32
FLOOR = frozenset({"w_attn", "norm1_out", "rope_out", "attn_out"})
FLOOR_FUSED = FLOOR | {"w_mlp", "norm2_out", "mlp_act"}
NOW = (BEFORE - STREAM) | {"norm_in"}            # stofc/lower/stream.py

ROWS: dict[str, tuple[frozenset[str], bool]] = {   # label -> (sites rounded, float16?)
    "before: package of 2026-11-25 (stream in T)": (BEFORE, False),
    "before, float16 instead": (BEFORE, True),
    "now: residual stream float32 (norms read it rounded)": (NOW, False),
    "now + RoPE reading the float32 Q/K GEMM result": (NOW - {"qkv_out"}, False),
    "floor, MLP in ORT: only GEMM/attention operands in T": (FLOOR, False),
    "floor, MLP in ORT, + P in T (GPU block-wise attention)": (FLOOR | {"attn_P"}, False),
    "ideal: GEMM writes attn@Wo in T, norm adds the fp32 stream": (
        (BEFORE - STREAM) | {"update"}, False),
    "gated FFN fused (WIP), stream in T": (FUSED_FFN, False),
    "gated FFN fused, stream float32 (as now)": ((FUSED_FFN - STREAM) | {"norm_in"}, False),
    "gated FFN fused, ideal (GEMMs write updates in T)": (
        (FUSED_FFN - STREAM) | {"update", "update_mlp"}, False),
    "floor with the gated FFN fused": (FLOOR_FUSED, False),
    "gated FFN fused, stream float32, float16 instead": ((FUSED_FFN - STREAM) | {"norm_in"},
                                                         True),
    "only the weights in T": (frozenset({"w_attn", "w_mlp"}), False),
    "only the attention weights in T": (frozenset({"w_attn"}), False),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="the exported llama model (e2e_long_models)")
    ap.add_argument("--seeds", type=int, default=8, help="input seeds 0..N-1 for the spread")
    ap.add_argument("--length", type=int, default=72, help="sequence length (check: 72)")
    ap.add_argument("--package", type=Path, action="append", default=[],
                    help="also run this compiled package on the same inputs (repeatable)")
    ap.add_argument("--sites", action="store_true", help="also each site alone / kept fp32")
    ap.add_argument("--save-feeds", type=Path,
                    help="write the inputs (and real-token masks) per seed to this .npz, for "
                         "bench/bf16_llama_torch.py")
    ns = ap.parse_args(argv)
    from stofc.frontend import load_model
    from stofc.masks import encode
    from stofc.package.load import CPU_EP, load
    from stofc.package.reference import inject_mask
    from stofc.package.verify import make_inputs

    graph = load_model(ns.model)
    fmt = encode("causal", ns.length)
    ref_model = inject_mask(graph, {layer.index: fmt for layer in graph.layers},
                            size=ns.length)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(ref_model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    del ref_model
    m = Llama(graph.model)
    print(f"model {ns.model.name}: {m.layers} layers, hidden {m.embed.shape[1]}, heads "
          f"{m.heads}/{m.kv_heads} x {m.head_dim}, FFN {m.w[0]['gate'].shape[1]}, eps {m.eps:g}")
    data = []
    for seed in range(ns.seeds):
        feeds, real = make_inputs(graph, 2, ns.length, np.random.default_rng(seed))
        data.append((feeds, real, sess.run(None, feeds)[0]))
    if ns.save_feeds:
        np.savez(ns.save_feeds, **{f"{k}{seed}": v for seed, (f, real, _) in enumerate(data)
                                   for k, v in [*f.items(), ("real", real)]})
    del sess

    def errors(rounded: frozenset[str], half: bool = False) -> np.ndarray:
        return np.array([rel(run(m, f["input_ids"], f["attention_mask"], rounded, half=half),
                             ref, real) for f, real, ref in data])

    print(f"numpy fp32 model vs ORT fp32 reference (sanity): {errors(frozenset()).max():.2e}")
    print(f"\nrel = max|pkg - ref| / max|ref| over real tokens at (2, {ns.length}); seed 0 = "
          f"compile's check inputs; mean / max / share > 1e-2 over seeds 0..{ns.seeds - 1}")
    print(f"| {'emulation (T = bfloat16 unless said)':<60} | seed 0    | mean      | max       "
          f"| > 1e-2 |\n| {'-' * 60} | --- | --- | --- | --- |")

    def row(label: str, es: np.ndarray) -> None:
        print(f"| {label:<60} | {es[0]:.3e} | {es.mean():.3e} | {es.max():.3e} | "
              f"{np.mean(es > 1e-2):6.0%} |", flush=True)

    for pkg in ns.package:
        session = load(pkg, providers=[CPU_EP],
                       session_options_hook=lambda o: setattr(o, "log_severity_level", 4))
        row(f"measured: {pkg.name} (CPU EP)", np.array(
            [rel(session.run(None, f)[0], ref, real) for f, real, ref in data]))
        del session
    for label, (rounded, half) in ROWS.items():
        row(label, errors(rounded, half))
    if ns.sites:
        for site in sorted(BEFORE, key=SITES.index):
            row(f"before, kept in fp32: {site}", errors(BEFORE - {site}))
        for site in SITES:
            row(f"only rounded: {site}", errors(frozenset({site})))


if __name__ == "__main__":
    main()
