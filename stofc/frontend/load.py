"""Read an ONNX file and canonicalize it: constants folded, shapes inferred, nodes named.

Every way a file can be wrong ends in one :class:`ModelError` line: not a file,
not ONNX, a truncated protobuf, missing external data, an empty graph.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnxscript import optimizer

from stofc.errors import ModelError

_LOG = logging.getLogger(__name__)


def read_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load ``path`` with its external data; raise ModelError naming the problem."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model file not found: {p}", hint="check the path")
    if not p.is_file():
        raise ModelError(f"not a file: {p}", hint="pass the path of a .onnx file")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError, TypeError, OSError) as err:
        raise ModelError(f"{p} is not a valid ONNX model (cannot parse the protobuf: "
                         f"{_one_line(err) or 'truncated or not ONNX'})",
                         hint="re-export the model or check that the file is complete") from None
    except Exception as err:  # protobuf raises a variety of internal errors
        raise ModelError(f"{p} is not a valid ONNX model ({type(err).__name__}: "
                         f"{_one_line(err)})", hint="re-export the model") from None
    if not model.HasField("graph") or len(model.graph.node) == 0:
        raise ModelError(f"{p} is not an ONNX model with a graph (no nodes found)",
                         hint="pass an exported .onnx model, not another file")
    _load_external(model, p)
    return model


def _load_external(model: onnx.ModelProto, path: Path) -> None:
    base = path.parent
    missing = set()
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = {e.key: e.value for e in tensor.external_data}.get("location", "")
        if not location or not (base / location).is_file():
            missing.add(location or "<no location>")
    if missing:
        names = ", ".join(sorted(missing))
        raise ModelError(f"external data of {path} not found: {names}",
                         hint=f"copy the data file(s) next to {path.name}")
    try:
        onnx.load_external_data_for_model(model, str(base))
    except Exception as err:
        raise ModelError(f"cannot read the external data of {path}: {_one_line(err)}",
                         hint="check the data file is complete") from None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


def canonicalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constants (shape arithmetic included), drop Identity, infer shapes, name nodes.

    Uses onnxscript's optimizer (over onnx-ir) when it succeeds; the matchers do
    not depend on it (they fold what they need themselves), so a failure there
    only logs and keeps the original graph.
    """
    model = _optimize(model)
    _name_nodes(model)
    return _infer_shapes(model)


def _optimize(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ir_model = ir.serde.deserialize_model(model)
            optimizer.optimize(ir_model, num_iterations=2)
            out = ir.serde.serialize_model(ir_model)
    except Exception as err:  # keep going on the unoptimized graph
        _LOG.warning("onnxscript optimizer failed (%s); using the graph as exported", err)
        return model
    return out


def _name_nodes(model: onnx.ModelProto) -> None:
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference (with data propagation) on a copy whose big weights are inputs.

    Weights are only needed for their shapes, so large initializers become typed
    graph inputs in the copy: inference is fast, and models over protobuf's 2 GiB
    limit work. The inferred ``value_info`` is copied back onto ``model``.
    """
    graph = model.graph
    light = onnx.ModelProto()
    light.CopyFrom(onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                                   functions=model.functions))
    light.graph.name = graph.name
    light.graph.node.extend(n for node in graph.node for n in _shape_stand_ins(node))
    light.graph.input.extend(graph.input)
    light.graph.output.extend(graph.output)
    light.graph.value_info.extend(graph.value_info)
    declared = {i.name for i in graph.input}
    for init in graph.initializer:
        numel = 1
        for d in init.dims:
            numel *= d
        if numel <= 4096:
            light.graph.initializer.append(init)
        elif init.name not in declared:
            light.graph.input.append(onnx.helper.make_tensor_value_info(
                init.name, init.data_type, list(init.dims)))
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception as err:
        _LOG.warning("ONNX shape inference failed (%s); shapes partly unknown", err)
        return model
    del graph.value_info[:]
    graph.value_info.extend(inferred.graph.value_info)
    outputs = {o.name: o for o in inferred.graph.output}
    for out in graph.output:
        if out.name in outputs and outputs[out.name].type.tensor_type.HasField("shape"):
            out.type.CopyFrom(outputs[out.name].type)
    return model


# ONNX Runtime's own norm ops and its RotaryEmbedding, unknown to ONNX shape inference (which
# then stops there): the outputs listed have the shape and type of input 0
_SAME_SHAPE_OUTPUTS = {"SimplifiedLayerNormalization": (0,),
                       "SkipSimplifiedLayerNormalization": (0, 3),
                       "SkipLayerNormalization": (0, 3),
                       "RotaryEmbedding": (0,)}


def _shape_stand_ins(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``[node]``, or for shape inference only, Identities of input 0 in place of an ONNX
    Runtime norm op (one per output of :data:`_SAME_SHAPE_OUTPUTS`; the others stay
    unknown)."""
    keep = _SAME_SHAPE_OUTPUTS.get(node.op_type)
    if keep is None or node.domain not in ("", "ai.onnx", "com.microsoft"):
        return [node]
    outs = [node.output[i] for i in keep if i < len(node.output) and node.output[i]]
    return [onnx.helper.make_node("Identity", [node.input[0]], [out], name=f"{node.name}/{i}")
            for i, out in enumerate(outs)]


def opset_of(model: onnx.ModelProto) -> int:
    """The default-domain opset the model imports."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0
