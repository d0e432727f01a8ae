"""``load_model``: the frontend stage, from a path to a :class:`ModelGraph`."""

from __future__ import annotations

import os
from dataclasses import replace

import onnx

from stofc.errors import ModelError
from stofc.frontend.attention import find_attention
from stofc.frontend.chain import build_chain
from stofc.frontend.graph import GraphIndex
from stofc.frontend.load import canonicalize, opset_of, read_model
from stofc.frontend.ops import Piece
from stofc.frontend.pack import pack_projections as pack
from stofc.frontend.pack_ffn import pack_gate_up
from stofc.frontend.rope_fuse import fuse_rope
from stofc.frontend.types import (
    AttentionBlock,
    ChainOp,
    Layer,
    ModelGraph,
    OpKind,
    Unsupported,
    ValueInfo,
)

_SHAPE_TYPES = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}


def load_model(path: str | os.PathLike, *, pack_projections: bool = False,
               pack_ffn: bool = True) -> ModelGraph:
    """Read, canonicalize and understand the ONNX model at ``path``.

    ``pack_projections`` first packs each block's separate Q, K, V projections
    into one MatMul + Add + Split (:mod:`stofc.frontend.pack`), so the chain
    holds one ``qkv`` GEMM as for GPT-2 (the compile path does; ``inspect``
    shows the model as exported). ``pack_ffn`` (on unless asked otherwise: the
    chain has no other form of a gated FFN, so ``inspect`` and ``compile`` agree)
    packs a gated FFN's separate gate and up projections into one MatMul + Split
    (:mod:`stofc.frontend.pack_ffn`).

    Returns one :class:`Layer` per attention block found (in graph order), the
    blocks and operators left to ONNX Runtime, and the canonicalized model.
    Raises :class:`ModelError` (one line) for a file that cannot be read, a
    graph without any attention, or a head count that is not a constant. A
    malformed graph that trips the analysis itself is reported the same way
    (``STOFC_DEBUG=1`` re-raises the original exception).
    """
    model = canonicalize(read_model(path))
    try:
        if pack_ffn:
            model = pack_gate_up(model).model
        if pack_projections:
            model = pack(model).model
        return _understand(path, model)
    except ModelError:
        raise
    except Exception as err:
        if os.environ.get("STOFC_DEBUG"):
            raise
        text = (str(err).strip().splitlines() or [""])[0][:200]
        raise ModelError(f"cannot analyse {path} (malformed graph?): {type(err).__name__}: "
                         f"{text}", hint="check the model with onnx.checker; STOFC_DEBUG=1 "
                         "shows the traceback") from None


def _understand(path: str | os.PathLike, model: onnx.ModelProto) -> ModelGraph:
    idx = GraphIndex(model)
    _refuse_training_mode(idx, path)
    blocks, unsupported = find_attention(idx)
    if not blocks and not unsupported:
        raise ModelError(f"no attention found in {path}: no Attention operator and no Softmax "
                         "over a product of two computed tensors (Q·Kᵀ)",
                         hint="pass a transformer model")
    layers_pieces: list[tuple[AttentionBlock, str, list[Piece]]] = []
    claimed: set[str] = set()
    for block in blocks:
        if claimed & set(block.nodes):  # two Softmax matched one block: keep the first
            continue
        block = fuse_rope(idx, replace(block, layer=len(layers_pieces)))
        order, pieces, stops = build_chain(idx, block)
        unsupported.extend(stops)
        claimed |= {n.name for p in pieces for n in p.nodes}
        layers_pieces.append((block, order, pieces))
    _absorb_helpers(idx, [p for _, _, pieces in layers_pieces for p in pieces])
    layers = []
    for block, order, pieces in layers_pieces:
        extra = [n.name for p in pieces if p.kind == OpKind.ATTENTION for n in p.nodes]
        block = replace(block, nodes=idx.in_order([*block.nodes, *extra]))
        chain = tuple(_chain_op(idx, i, p) for i, p in enumerate(pieces))
        layers.append(Layer(index=block.layer, norm_order=order, attention=block, chain=chain))
    covered = {n for layer in layers for op in layer.chain for n in op.nodes}
    left = tuple(n.name for n in idx.nodes if n.name not in covered)
    sources = {layer.attention.mask_source for layer in layers} - {None}
    padding = min(s for s in sources if s is not None) if sources else None
    return ModelGraph(
        path=str(path), opset=opset_of(model), inputs=_values(idx, model.graph.input),
        outputs=_values(idx, model.graph.output), layers=tuple(layers),
        unsupported=tuple(_dedupe(unsupported)), left_to_ort=left,
        padding_mask_input=padding, model=model)


def _refuse_training_mode(idx: GraphIndex, path) -> None:
    """A Dropout that is on (training_mode=True) means the export was not for inference."""
    for node in idx.nodes:
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            mode = idx.const(node.input[2])
            if mode is not None and bool(mode.reshape(-1)[0]):
                raise ModelError(f"{path} was exported in training mode (Dropout {node.name} is "
                                 "active)", hint="call model.eval() before torch.onnx.export")


def _absorb_helpers(idx: GraphIndex, pieces: list[Piece]) -> None:
    """Give shape arithmetic and Constant nodes used by one chain op only to that op."""
    owner = {}
    for i, piece in enumerate(pieces):
        for node in piece.nodes:
            owner[node.name] = i
    for node in reversed(idx.nodes):
        if node.name in owner:
            continue
        outs = [o for o in node.output if o]
        if not outs or any(idx.is_graph_output(o) for o in outs):
            continue
        if node.op_type != "Constant" and not all(idx.elem_type(o) in _SHAPE_TYPES
                                                  for o in outs):
            continue
        users = {owner.get(u.name, -1) for o in outs for u in idx.users(o)}
        if len(users) == 1 and -1 not in users:
            target = users.pop()
            owner[node.name] = target
            pieces[target].nodes.append(node)
    for piece in pieces:
        piece.nodes.sort(key=lambda n: idx.position[n.name])


def _chain_op(idx: GraphIndex, index: int, piece: Piece) -> ChainOp:
    names = {n.name for n in piece.nodes}
    produced = {o for n in piece.nodes for o in n.output if o}
    inputs = piece.inputs
    if inputs is None:
        inputs = tuple(dict.fromkeys(
            i for n in piece.nodes for i in n.input
            if i and i not in produced and not idx.is_initializer_like(i)
            and idx.const(i) is None))
    outputs = piece.outputs
    if outputs is None:
        outputs = tuple(dict.fromkeys(
            o for n in piece.nodes for o in n.output
            if o and (idx.is_graph_output(o) or any(u.name not in names for u in idx.users(o)))))
    return ChainOp(index=index, kind=piece.kind, role=piece.role,
                   nodes=idx.in_order(names), inputs=tuple(inputs), outputs=tuple(outputs),
                   params=tuple(piece.params.items()))


def _values(idx: GraphIndex, infos) -> tuple[ValueInfo, ...]:
    out = []
    for vi in infos:
        if vi.name in idx.initializers:
            continue
        elem = vi.type.tensor_type.elem_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem).name
        except Exception:
            dtype = str(elem)
        out.append(ValueInfo(vi.name, dtype, idx.shape(vi.name) or ()))
    return tuple(out)


def _dedupe(items: list[Unsupported]) -> list[Unsupported]:
    return list(dict.fromkeys(items))
