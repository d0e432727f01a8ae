"""Which activation values each chain operator reads and writes.

The frontend's :class:`~stofc.frontend.types.ChainOp` lists ONNX value names,
initializers included, and a Gemm with a C input is split into a ``gemm`` with
no output and a ``bias_add`` carrying the node's inputs and output. This module
reduces that to a plain dataflow over *activations*: per operator, the values
it consumes (weights, biases and norm scales removed) and the one value it
produces. Values that do not exist in the graph get a virtual name
(``<node>/matmul``).

Special cases, stated as contract:

* a ``bias_add`` right after a ``gemm`` consumes that gemm's output;
* ``attention`` consumes the projection results (the output of each q/k/v/qkv
  GEMM, or of the ``bias_add`` that follows it);
* a GEMM after attention whose input no chain operator produces reads the
  attention output (the head merge between them is the attention's own).
"""

from __future__ import annotations

from dataclasses import dataclass

from stofc.frontend.types import ChainOp, Layer, OpKind

PROJECTION_ROLES = frozenset({"qkv", "q", "k", "v"})


@dataclass(frozen=True)
class OpFlow:
    """One operator's activation inputs (in order) and its output value."""

    index: int
    kind: OpKind
    inputs: tuple[str, ...]
    output: str


def _param_values(op: ChainOp) -> set[str]:
    names = set()
    for key in ("weight", "bias", "scale"):
        value = op.param(key)
        if isinstance(value, str):
            names.add(value)
    return names


def _own_output(op: ChainOp) -> str:
    if op.outputs:
        return op.outputs[0]
    stem = op.nodes[0] if op.nodes else f"op{op.index}"
    return f"{stem}/{op.kind.value}"


def resolve_dataflow(layer: Layer) -> tuple[OpFlow, ...]:
    """The activation dataflow of ``layer.chain`` (see the module contract)."""
    chain = layer.chain
    flows: list[OpFlow] = []
    produced: set[str] = set()
    attention_out: str | None = None
    for pos, op in enumerate(chain):
        output = _own_output(op)
        params = _param_values(op)
        if op.kind == OpKind.BIAS_ADD and pos > 0 and chain[pos - 1].kind == OpKind.GEMM:
            inputs: tuple[str, ...] = (flows[pos - 1].output,)
        elif op.kind == OpKind.ATTENTION:
            inputs = tuple(_projection_results(chain, flows))
            attention_out = output
        else:
            inputs = tuple(v for v in op.inputs if v not in params)
            if op.kind in (OpKind.GEMM, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.GELU,
                           OpKind.ACTIVATION, OpKind.BIAS_ADD, OpKind.GATED):
                inputs = inputs[:1]
            if (op.kind == OpKind.GEMM and attention_out is not None and inputs
                    and inputs[0] not in produced and pos > 0):
                inputs = (attention_out,)
        flows.append(OpFlow(index=pos, kind=op.kind, inputs=inputs, output=output))
        produced.add(output)
    return tuple(flows)


def _projection_results(chain: tuple[ChainOp, ...], flows: list[OpFlow]) -> list[str]:
    results = []
    for pos, flow in enumerate(flows):
        if chain[pos].kind == OpKind.GEMM and chain[pos].role in PROJECTION_ROLES:
            nxt = pos + 1
            if nxt < len(flows) and chain[nxt].kind == OpKind.BIAS_ADD:
                results.append(flows[nxt].output)
            elif nxt < len(chain) and chain[nxt].kind == OpKind.BIAS_ADD:
                results.append(_own_output(chain[nxt]))
            else:
                results.append(flow.output)
    return results


def consumers(flows: tuple[OpFlow, ...]) -> dict[str, tuple[int, ...]]:
    """For each value, the chain positions that read it."""
    users: dict[str, list[int]] = {}
    for flow in flows:
        for value in flow.inputs:
            users.setdefault(value, []).append(flow.index)
    return {k: tuple(v) for k, v in users.items()}


def value_widths(layer: Layer) -> dict[str, int]:
    """Feature width of every activation: GEMMs set it (out_features), a gated operator
    halves it (``features``), others keep it.

    The layer input and the attention output have the hidden size.
    """
    hidden = layer.attention.hidden_size
    widths: dict[str, int] = {}
    for flow, op in zip(resolve_dataflow(layer), layer.chain, strict=True):
        for value in flow.inputs:
            widths.setdefault(value, hidden)
        if op.kind == OpKind.GEMM:
            widths[flow.output] = int(op.param("out_features"))
        elif op.kind == OpKind.ATTENTION:
            widths[flow.output] = hidden
        elif op.kind == OpKind.GATED:
            widths[flow.output] = int(op.param("features"))
        else:
            widths[flow.output] = widths[flow.inputs[0]] if flow.inputs else hidden
    return widths
