"""The honest reference for ``stofc verify``: the original graph with the structured mask.

The original model knows nothing of the structured mask, so comparing the
package with it would compare two different functions (unless the mask is
``dense``). The reference is the canonicalized original model, in float32,
with one change per attention block: before its Softmax, the scores get
``+ bias`` where ``bias[h, i, j] = 0`` if the structured mask allows key
``j`` for query ``i`` (head ``h``) and ``-1e9`` otherwise, sliced at run time
to the actual ``S x S`` (the top-left corner of the ``L_max`` mask, as MASKS.md
says). Everything else (the model's own padding mask, an in-graph causal
mask, T5's relative bias) stays, so the reference computes exactly the
function the package is meant to compute: the model's own masking AND the
structured mask.

Rows where every key is masked differ by design (the package writes zeros,
the reference a uniform average); they only occur at padded query positions,
which ``stofc verify`` does not compare.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from stofc.errors import StofcError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import ModelGraph
from stofc.masks.format import MaskFormat
from stofc.package.rewrite import float_type

MASKED = -1e9


def _bias_array(fmt: MaskFormat, rank: int) -> np.ndarray:
    dense = np.stack([fmt.to_dense(h) for h in range(fmt.num_heads)])  # [Hf, L, L]
    bias = np.where(dense, 0.0, MASKED).astype(np.float32)
    if rank == 4:
        return bias[None]                       # [1, Hf, L, L]
    if fmt.num_heads != 1:
        raise StofcError("a per-head structured mask cannot be injected into scores of rank 3",
                         hint="verify with a mask shared by all heads")
    return bias.reshape((1,) * (rank - 2) + bias.shape[1:])


def inject_mask(graph: ModelGraph, formats: dict[int, MaskFormat]) -> onnx.ModelProto:
    """The reference model: ``graph.model`` with ``formats[layer]`` added before each Softmax."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    idx = GraphIndex(model)
    new_nodes: dict[str, list[onnx.NodeProto]] = {}
    shared: dict[tuple[str, int], str] = {}
    for layer in graph.layers:
        block = layer.attention
        fmt = formats[layer.index]
        softmax = [idx.by_name[n] for n in block.nodes if idx.by_name[n].op_type == "Softmax"]
        if len(softmax) != 1:
            raise StofcError(f"layer {layer.index}: no single Softmax to add the structured "
                             "mask to (an ONNX Attention op?)",
                             hint="verify this model with --mask dense only")
        node = softmax[0]
        scores = node.input[0]
        rank = idx.rank(scores) or 4
        key = (fmt.spec_hash, rank)
        if key not in shared:
            name = f"stofc_ref/mask_bias_{len(shared)}"
            model.graph.initializer.append(numpy_helper.from_array(_bias_array(fmt, rank), name))
            shared[key] = name
        p = f"stofc_ref/l{layer.index}"
        shape, axes = f"{p}/shape", f"{p}/axes"
        model.graph.initializer.extend([
            numpy_helper.from_array(np.array([-1], np.int64), f"{p}/minus1"),
            numpy_helper.from_array(np.array([2**62], np.int64), f"{p}/end"),
            numpy_helper.from_array(np.array([0, 0], np.int64), f"{p}/zeros"),
            numpy_helper.from_array(np.array([rank - 2, rank - 1], np.int64), axes),
        ])
        elem = idx.elem_type(scores) or float_type(idx)
        bias = shared[key]
        nodes = [
            helper.make_node("Shape", [scores], [shape], name=f"{p}/Shape"),
            helper.make_node("Slice", [shape, f"{p}/minus1", f"{p}/end"], [f"{p}/s"],
                             name=f"{p}/LastDim"),
            helper.make_node("Concat", [f"{p}/s", f"{p}/s"], [f"{p}/ends"], name=f"{p}/Ends",
                             axis=0),
            helper.make_node("Slice", [bias, f"{p}/zeros", f"{p}/ends", axes], [f"{p}/bias"],
                             name=f"{p}/Corner"),
        ]
        if elem != TensorProto.FLOAT:
            nodes.append(helper.make_node("Cast", [f"{p}/bias"], [f"{p}/bias_t"],
                                          name=f"{p}/Cast", to=elem))
        biased = f"{p}/scores"
        nodes.append(helper.make_node("Add", [scores, nodes[-1].output[0]], [biased],
                                      name=f"{p}/AddMask"))
        node.input[0] = biased
        new_nodes[node.name] = nodes
    ordered = []
    for node in model.graph.node:
        ordered.extend(new_nodes.get(node.name, []))
        ordered.append(node)
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    return model
