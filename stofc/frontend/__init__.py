"""The frontend stage: ONNX file -> :class:`ModelGraph` (attention blocks + layer chains).

``load_model(path)`` reads the model (external data too), canonicalizes it and
recognises, per layer, the attention block and the dense operators around it.
No GPU is involved. See :mod:`stofc.frontend.types` for the contract.

Why these tools. Canonicalization runs onnxscript's optimizer over an onnx-ir
model: it folds constants and the shape arithmetic exporters emit (TorchScript
exports are about half Shape/Gather/Unsqueeze/Concat/Constant nodes), removes
Identity nodes and dead code, and keeps node names, in one well-tested pass;
then ``onnx.shape_inference`` with data propagation gives every value a shape
with symbolic batch and sequence. The pattern matching itself is ours, over a
small read-only index of the ONNX protobuf (:mod:`stofc.frontend.graph`): it
walks dataflow outwards from each Softmax (or ``Attention`` op) and classifies
what it finds, rather than declaring one rewrite pattern per exporter variant,
so operand order, extra casts, guards and layout detours do not need a
pattern each, and it reports *why* a block does not fit. The matchers fold the
constants they need themselves, so they still work if the optimizer fails
(it then only logs a warning). Dependencies: ``onnx``, ``onnx-ir``,
``onnxscript`` (optimizer), ``numpy``.
"""

from stofc.frontend.model import load_model
from stofc.frontend.types import (
    AttentionBlock,
    ChainOp,
    Layer,
    ModelGraph,
    OpKind,
    Unsupported,
    ValueInfo,
)

__all__ = ["AttentionBlock", "ChainOp", "Layer", "ModelGraph", "OpKind", "Unsupported",
           "ValueInfo", "load_model"]
