"""Build a small BERT-like encoder as ONNX with ``onnx.helper`` only (no torch).

The graph follows what ``torch.onnx.export(..., dynamo=False, opset_version=17)``
writes for a BERT encoder with eager attention: embeddings (word + position +
token type) and LayerNormalization; the padding mask ``attention_mask`` turned
into an additive mask ``(1 - mask) * -10000`` of shape [B, 1, 1, S]; per layer
MatMul+Add projections for Q, K and V, head split by Reshape to a shape
assembled from ``Shape``/``Gather``/``Unsqueeze``/``Concat`` (dynamic batch and
sequence), Transpose (K transposed straight to [B, H, D, S]), ``Q Kᵀ``, Div by
``sqrt(head_dim)``, Add of the mask, Softmax, ``P V``, head merge, output
projection, residual, LayerNormalization, FFN with the exact (Erf) GELU,
residual, LayerNormalization. Weights are drawn from numpy with a fixed seed, so
the same options give the same file.

Usage::

    python examples/build_model.py -o model.onnx [--layers 2 --hidden 128 --heads 4
                                                   --seq 128 --ffn 512 --vocab 1000]

``build_model(...)`` returns the ModelProto for tests and the demo.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _Builder:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.counter = 0

    def weight(self, name: str, shape: tuple[int, ...], scale: float = 0.05,
               offset: float = 0.0) -> str:
        data = (self.rng.standard_normal(shape) * scale + offset).astype(np.float32)
        self.inits.append(numpy_helper.from_array(data, name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        self.counter += 1
        name = f"/Constant_{self.counter}_output_0"
        self.nodes.append(helper.make_node(
            "Constant", [], [name], name=f"/Constant_{self.counter}",
            value=numpy_helper.from_array(np.asarray(value, dtype=dtype))))
        return name

    def op(self, op_type: str, inputs: list[str], scope: str, **attrs) -> str:
        self.counter += 1
        name = f"{scope}/{op_type}_{self.counter}"
        out = f"{name}_output_0"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    def dims(self, x: str, scope: str, *axes: int) -> list[str]:
        """1-D int64 tensors holding x.shape[axis] (the TorchScript exporter's spelling)."""
        shape = self.op("Shape", [x], scope)
        return [self.op("Unsqueeze", [self.op("Gather", [shape, self.const(a)], scope, axis=0),
                                      self.const([0])], scope) for a in axes]

    def linear(self, x: str, n_in: int, n_out: int, scope: str) -> str:
        w = self.weight(f"{scope}.weight", (n_in, n_out))
        b = self.weight(f"{scope}.bias", (n_out,), scale=0.02)
        return self.op("Add", [b, self.op("MatMul", [x, w], scope)], scope)

    def layernorm(self, x: str, n: int, scope: str) -> str:
        g = self.weight(f"{scope}.weight", (n,), scale=0.05, offset=1.0)
        b = self.weight(f"{scope}.bias", (n,), scale=0.02)
        return self.op("LayerNormalization", [x, g, b], scope, axis=-1, epsilon=1e-12)


def _attention(bld: _Builder, x: str, mask: str, hidden: int, heads: int, scope: str) -> str:
    d = hidden // heads
    batch, seq = bld.dims(x, scope, 0, 1)
    split = bld.op("Concat", [batch, seq, bld.const([heads]), bld.const([d])], scope, axis=0)

    def heads_of(name: str, perm: list[int]) -> str:
        proj = bld.linear(x, hidden, hidden, f"{scope}.{name}")
        return bld.op("Transpose", [bld.op("Reshape", [proj, split], scope)], scope, perm=perm)

    q = heads_of("query", [0, 2, 1, 3])
    k = heads_of("key", [0, 2, 3, 1])
    v = heads_of("value", [0, 2, 1, 3])
    scores = bld.op("MatMul", [q, k], scope)
    scaled = bld.op("Div", [scores, bld.const(math.sqrt(d), np.float32)], scope)
    masked = bld.op("Add", [scaled, mask], scope)
    probs = bld.op("Softmax", [masked], scope, axis=-1)
    ctx = bld.op("Transpose", [bld.op("MatMul", [probs, v], scope)], scope, perm=[0, 2, 1, 3])
    merge = bld.op("Concat", [batch, seq, bld.const([hidden])], scope, axis=0)
    return bld.op("Reshape", [ctx, merge], scope)


def _layer(bld: _Builder, x: str, mask: str, hidden: int, heads: int, ffn: int, i: int) -> str:
    scope = f"/encoder/layer.{i}"
    ctx = _attention(bld, x, mask, hidden, heads, f"{scope}/attention/self")
    out = bld.linear(ctx, hidden, hidden, f"{scope}/attention/output/dense")
    h = bld.layernorm(bld.op("Add", [out, x], scope), hidden, f"{scope}/attention/output/LayerNorm")
    inter = bld.linear(h, hidden, ffn, f"{scope}/intermediate/dense")
    act = f"{scope}/intermediate/gelu"
    erf = bld.op("Erf", [bld.op("Div", [inter, bld.const(math.sqrt(2.0), np.float32)], act)], act)
    gelu = bld.op("Mul", [bld.op("Mul", [inter, bld.op("Add", [erf, bld.const(1.0, np.float32)],
                                                       act)], act),
                          bld.const(0.5, np.float32)], act)
    down = bld.linear(gelu, ffn, hidden, f"{scope}/output/dense")
    return bld.layernorm(bld.op("Add", [down, h], scope), hidden, f"{scope}/output/LayerNorm")


def build_model(*, layers: int = 2, hidden: int = 128, heads: int = 4, seq: int = 128,
                ffn: int | None = None, vocab: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """A BERT-like encoder (inputs ``input_ids``, ``attention_mask`` [B, S] int64;
    output ``last_hidden_state`` [B, S, hidden] float32); ``seq`` is the maximum length."""
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    ffn = ffn or 4 * hidden
    bld = _Builder(np.random.default_rng(seed))
    emb = "/embeddings"
    words = bld.op("Gather", [bld.weight("embeddings.word_embeddings.weight", (vocab, hidden)),
                              "input_ids"], emb, axis=0)
    (seq_dim,) = bld.dims("input_ids", emb, 1)
    pos_ids = numpy_helper.from_array(np.arange(seq, dtype=np.int64)[None, :],
                                      "embeddings.position_ids")
    bld.inits.append(pos_ids)
    positions = bld.op("Slice", ["embeddings.position_ids", bld.const([0]), seq_dim,
                                 bld.const([1])], emb)
    pos = bld.op("Gather", [bld.weight("embeddings.position_embeddings.weight", (seq, hidden)),
                            positions], emb, axis=0)
    types = bld.weight("embeddings.token_type_embeddings.weight", (2, hidden))
    type0 = bld.op("Gather", [types, bld.const(0)], emb, axis=0)
    x = bld.op("Add", [bld.op("Add", [words, type0], emb), pos], emb)
    x = bld.layernorm(x, hidden, f"{emb}/LayerNorm")
    ext = bld.op("Unsqueeze", ["attention_mask", bld.const([1, 2])], "/mask")
    ext = bld.op("Cast", [ext], "/mask", to=TensorProto.FLOAT)
    inv = bld.op("Sub", [bld.const(1.0, np.float32), ext], "/mask")
    mask = bld.op("Mul", [inv, bld.const(-10000.0, np.float32)], "/mask")
    for i in range(layers):
        x = _layer(bld, x, mask, hidden, heads, ffn, i)
    out = helper.make_node("Identity", [x], ["last_hidden_state"], name="/output/Identity")
    graph = helper.make_graph(
        [*bld.nodes, out], "bert_like",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                       ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT,
                                       ["batch", "sequence", hidden])],
        bld.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="stofc-examples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="model.onnx", help="file to write")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128, help="maximum sequence length")
    parser.add_argument("--ffn", type=int, default=None, help="FFN width (default 4*hidden)")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    model = build_model(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, seq=ns.seq,
                        ffn=ns.ffn, vocab=ns.vocab, seed=ns.seed)
    path = Path(ns.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): {ns.layers} layers, "
          f"hidden {ns.hidden}, {ns.heads} heads, max length {ns.seq}")
    return path


if __name__ == "__main__":
    main()
