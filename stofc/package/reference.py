"""The honest reference for ``stofc verify``: the original graph with the structured mask.

The original model knows nothing of the structured mask, so comparing the
package with it would compare two different functions (unless the mask is
``dense``). The reference is the canonicalized original model, in float32,
with one change per attention block: before its Softmax, the scores get
``+ bias`` (for an ONNX ``Attention`` op, its ``attn_mask`` input is combined
with the structured mask) where ``bias[h, i, j] = 0`` if the structured mask allows key
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
from stofc.lower.rewrite import float_type
from stofc.masks.decode import to_dense
from stofc.masks.format import MaskFormat

MASKED = -1e9


def _bias_array(fmt: MaskFormat, rank: int, size: int | None = None) -> np.ndarray:
    dense = np.stack([to_dense(fmt, h, size) for h in range(fmt.num_heads)])  # [Hf, L, L]
    bias = np.where(dense, 0.0, MASKED).astype(np.float32)
    if rank == 4:
        return bias[None]                       # [1, Hf, L, L]
    if fmt.num_heads != 1:
        raise StofcError("a per-head structured mask cannot be injected into scores of rank 3",
                         hint="verify with a mask shared by all heads")
    return bias.reshape((1,) * (rank - 2) + bias.shape[1:])


def inject_mask(graph: ModelGraph, formats: dict[int, MaskFormat], *,
                size: int | None = None) -> onnx.ModelProto:
    """The reference model: ``graph.model`` with ``formats[layer]`` applied in every block.

    ``size``: the longest sequence the reference will run; its constants then hold only
    the top-left ``size x size`` of each mask (all a run of ``S <= size`` reads) instead
    of ``L_max x L_max``.

    Before a Softmax: ``scores + bias``. For an ONNX ``Attention`` op (opset
    23): its ``attn_mask`` input becomes ``attn_mask AND allowed`` (boolean),
    ``attn_mask + bias`` (float) or ``bias`` when it had none.
    """
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    idx = GraphIndex(model)
    new_nodes: dict[str, list[onnx.NodeProto]] = {}
    shared: dict[tuple[str, int, bool], str] = {}

    def constant(fmt: MaskFormat, rank: int, boolean: bool) -> str:
        key = (fmt.spec_hash, rank, boolean)
        if key not in shared:
            name = f"stofc_ref/mask_{'allowed' if boolean else 'bias'}_{len(shared)}"
            array = _bias_array(fmt, rank, size)
            model.graph.initializer.append(
                numpy_helper.from_array(array == 0 if boolean else array, name))
            shared[key] = name
        return shared[key]

    for layer in graph.layers:
        block, fmt = layer.attention, formats[layer.index]
        p = f"stofc_ref/l{layer.index}"
        ops = {idx.by_name[n].op_type: idx.by_name[n] for n in block.nodes}
        if "Softmax" in ops and [idx.by_name[n].op_type for n in block.nodes].count("Softmax") == 1:
            node = ops["Softmax"]
            scores = node.input[0]
            rank = idx.rank(scores) or 4
            nodes = _corner(model, p, scores, -1, constant(fmt, rank, False), rank)
            elem = idx.elem_type(scores) or float_type(idx)
            if elem != TensorProto.FLOAT:
                nodes.append(helper.make_node("Cast", [nodes[-1].output[0]], [f"{p}/bias_t"],
                                              name=f"{p}/Cast", to=elem))
            nodes.append(helper.make_node("Add", [scores, nodes[-1].output[0]], [f"{p}/scores"],
                                          name=f"{p}/AddMask"))
            node.input[0] = f"{p}/scores"
        elif "Attention" in ops:
            node = ops["Attention"]
            q = node.input[0]
            mask = node.input[3] if len(node.input) > 3 and node.input[3] else None
            boolean = mask is not None and idx.elem_type(mask) == TensorProto.BOOL
            nodes = _corner(model, p, q, -2, constant(fmt, 4, boolean), 4)
            value = nodes[-1].output[0]
            elem = idx.elem_type(q) or float_type(idx)
            if not boolean and elem != TensorProto.FLOAT:
                nodes.append(helper.make_node("Cast", [value], [f"{p}/bias_t"], name=f"{p}/Cast",
                                              to=elem))
                value = f"{p}/bias_t"
            if mask is not None:
                nodes.append(helper.make_node("And" if boolean else "Add", [mask, value],
                                              [f"{p}/attn_mask"], name=f"{p}/CombineMask"))
                value = f"{p}/attn_mask"
            inputs = list(node.input) + [""] * (4 - len(node.input))
            inputs[3] = value
            del node.input[:]
            node.input.extend(inputs)
        else:
            raise StofcError(f"layer {layer.index}: no single Softmax or Attention op to apply "
                             "the structured mask to", hint="report the model to stofc")
        new_nodes[node.name] = nodes
    ordered = []
    for node in model.graph.node:
        ordered.extend(new_nodes.get(node.name, []))
        ordered.append(node)
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    return model


def _corner(model: onnx.ModelProto, p: str, like: str, axis: int, const: str,
            rank: int) -> list[onnx.NodeProto]:
    """Nodes slicing the top-left ``S x S`` of ``const``, S = ``like``'s dim ``axis`` (< 0)."""
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array([axis], np.int64), f"{p}/axis_start"),
        numpy_helper.from_array(np.array([axis + 1 if axis < -1 else 2**62], np.int64),
                                f"{p}/axis_end"),
        numpy_helper.from_array(np.array([0, 0], np.int64), f"{p}/zeros"),
        numpy_helper.from_array(np.array([rank - 2, rank - 1], np.int64), f"{p}/axes"),
    ])
    return [
        helper.make_node("Shape", [like], [f"{p}/shape"], name=f"{p}/Shape"),
        helper.make_node("Slice", [f"{p}/shape", f"{p}/axis_start", f"{p}/axis_end"], [f"{p}/s"],
                         name=f"{p}/SeqLen"),
        helper.make_node("Concat", [f"{p}/s", f"{p}/s"], [f"{p}/ends"], name=f"{p}/Ends", axis=0),
        helper.make_node("Slice", [const, f"{p}/zeros", f"{p}/ends", f"{p}/axes"],
                         [f"{p}/corner"], name=f"{p}/Corner"),
    ]
