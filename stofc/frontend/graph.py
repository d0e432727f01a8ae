"""A read-only index over an ONNX graph: producers, consumers, constants, shapes.

The matchers walk dataflow through this index, never through node names.
:meth:`GraphIndex.const` folds small constant subgraphs (Constant nodes,
initializers, Cast/Reshape/Unsqueeze/arithmetic on them) and
:meth:`GraphIndex.partial` evaluates shape vectors whose entries are partly
symbolic (``Concat(Shape(x)[0], Shape(x)[1], 12, 64)`` -> ``[None, None, 12, 64]``),
which is how exporters spell the head split.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX Div of constants: ``//`` on integers, ``/`` otherwise."""
    return a // b if np.issubdtype(a.dtype, np.integer) else a / b


_ARITH: dict[str, Callable[..., Any]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": _div, "Pow": np.power,
    "Max": np.maximum, "Min": np.minimum, "Equal": np.equal, "Less": np.less,
    "Greater": np.greater, "And": np.logical_and, "Or": np.logical_or,
}
_UNARY: dict[str, Callable[..., Any]] = {"Sqrt": np.sqrt, "Reciprocal": np.reciprocal, "Neg": np.negative, "Abs": np.abs,
          "Identity": lambda x: x, "Not": np.logical_not, "Floor": np.floor, "Ceil": np.ceil}


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


class GraphIndex:
    """Producers, consumers, constants and inferred shapes of one (main) graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.model = model
        self.nodes: list[onnx.NodeProto] = list(graph.node)
        self.position = {n.name: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers.setdefault(inp, []).append(node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_inputs = [i.name for i in graph.input if i.name not in self.initializers]
        self.graph_outputs = [o.name for o in graph.output]
        self._types: dict[str, onnx.TypeProto] = {}
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            self._types[vi.name] = vi.type
        self._const_cache: dict[str, np.ndarray | None] = {}
        self.memo: dict[str, dict] = {}  # per-analysis caches (e.g. mask probes)
        # Values computed from graph-input *data* (not only shapes) are never constant:
        # knowing them up front keeps constant folding shallow on deep graphs.
        self.data_dependent: set[str] = set(self.graph_inputs)
        for node in self.nodes:  # topological order (ONNX requires it)
            if node.op_type in ("Shape", "Size"):
                continue
            if any(i in self.data_dependent for i in node.input if i):
                self.data_dependent.update(o for o in node.output if o)

    # ---------------------------------------------------------------- structure
    def users(self, value: str) -> list[onnx.NodeProto]:
        """Nodes consuming ``value`` (graph outputs are not nodes)."""
        return self.consumers.get(value, [])

    def produced_by(self, value: str, *op_types: str) -> onnx.NodeProto | None:
        """The producer of ``value`` if its op type is one of ``op_types`` (any when empty)."""
        node = self.producer.get(value)
        if node is not None and (not op_types or node.op_type in op_types):
            return node
        return None

    def is_graph_output(self, value: str) -> bool:
        return value in self.graph_outputs

    def sole_user(self, value: str) -> onnx.NodeProto | None:
        """The only consumer of ``value`` (None if several, none, or a graph output)."""
        users = self.users(value)
        if len(users) == 1 and not self.is_graph_output(value):
            return users[0]
        return None

    def data_users(self, value: str) -> list[onnx.NodeProto]:
        """Consumers of ``value``'s data: Shape/Size nodes (which read only its shape) left out."""
        return [u for u in self.users(value) if u.op_type not in ("Shape", "Size")]

    def sole_data_user(self, value: str) -> onnx.NodeProto | None:
        """The only consumer of ``value``'s data (None if several, none, or a graph output)."""
        users = self.data_users(value)
        if len(users) == 1 and not self.is_graph_output(value):
            return users[0]
        return None

    def ancestors(self, value: str, *, through_shape: bool = False,
                  limit: int = 400) -> list[onnx.NodeProto]:
        """Producers reachable backwards from ``value``, nearest first (breadth-first; not
        through Shape/Size unless asked), at most ``limit`` of them."""
        seen: dict[str, onnx.NodeProto] = {}
        stack = deque([value])
        while stack and len(seen) < limit:
            node = self.producer.get(stack.popleft())
            if node is None or node.name in seen:
                continue
            seen[node.name] = node
            if node.op_type in ("Shape", "Size") and not through_shape:
                continue
            stack.extend(i for i in node.input if i)
        return list(seen.values())

    def sources(self, value: str) -> set[str]:
        """Graph inputs whose *data* (not only their shape) flows into ``value``."""
        found = set()
        stack, seen = [value], set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in self.graph_inputs:
                found.add(v)
            node = self.producer.get(v)
            if node is None or node.op_type in ("Shape", "Size"):
                continue
            stack.extend(i for i in node.input if i)
        return found

    # ---------------------------------------------------------------- shapes
    def shape(self, value: str) -> tuple[int | str | None, ...] | None:
        """Inferred shape: ints for static dims, symbols (str) or None for dynamic ones."""
        init = self.initializers.get(value)
        if init is not None:
            return tuple(int(d) for d in init.dims)
        const = self.const(value)
        if const is not None:
            return tuple(int(d) for d in const.shape)
        t = self._types.get(value)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        dims: list[int | str | None] = []
        for d in t.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
        return tuple(dims)

    def rank(self, value: str) -> int | None:
        shape = self.shape(value)
        return None if shape is None else len(shape)

    def elem_type(self, value: str) -> int | None:
        init = self.initializers.get(value)
        if init is not None:
            return init.data_type
        t = self._types.get(value)
        if t is not None and t.HasField("tensor_type"):
            return t.tensor_type.elem_type
        return None

    # ---------------------------------------------------------------- constants
    def const(self, value: str) -> np.ndarray | None:
        """The value of ``value`` if it is a (foldable) constant, else None."""
        if value in self._const_cache:
            return self._const_cache[value]
        if value in self.data_dependent:
            return None
        self._const_cache[value] = None  # cycle guard
        result = self._fold(value)
        self._const_cache[value] = result
        return result

    def scalar(self, value: str) -> float | None:
        """A constant with exactly one element, as a float."""
        c = self.const(value)
        if c is None or c.size != 1:
            return None
        return float(c.reshape(()))

    def is_initializer_like(self, value: str) -> bool:
        """A learned constant: an initializer, maybe through Transpose/Cast/Identity."""
        node = self.producer.get(value)
        if value in self.initializers:
            return True
        if node is None:
            return False
        if node.op_type == "Constant":
            return True
        if node.op_type in ("Transpose", "Cast", "Identity", "DequantizeLinear"):
            return self.is_initializer_like(node.input[0])
        return False

    def weight_name(self, value: str) -> str:
        """The initializer behind a learned constant (through Transpose/Cast/Identity)."""
        node = self.producer.get(value)
        if value in self.initializers or node is None or node.op_type == "Constant":
            return value
        return self.weight_name(node.input[0])

    def _fold(self, value: str) -> np.ndarray | None:
        init = self.initializers.get(value)
        if init is not None:
            if init.data_location == onnx.TensorProto.EXTERNAL and not init.raw_data:
                return None
            return numpy_helper.to_array(init)
        node = self.producer.get(value)
        if node is None:
            return None
        op = node.op_type
        if op == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_float", "value_int"):
                    return np.array(onnx.helper.get_attribute_value(a))
                if a.name in ("value_floats", "value_ints"):
                    return np.array(list(onnx.helper.get_attribute_value(a)))
            return None
        if op == "Shape":
            shape = self.shape(node.input[0])
            if shape is None or not all(isinstance(d, int) for d in shape):
                return None
            start, end = _attr(node, "start", 0), _attr(node, "end", None)
            return np.array(shape[start:end], dtype=np.int64)
        if op in ("Slice", "Gather") and self.producer.get(node.input[0]) is not None \
                and self.producer[node.input[0]].op_type == "Shape":
            # the static part of a partly symbolic shape (Optimum's scale: Shape(q)[-1])
            known = self.partial(value)
            index = self.const(node.input[1]) if op == "Gather" else None
            if known is not None and all(d is not None for d in known):
                if index is not None and index.ndim == 0:
                    return np.array(known[0], dtype=np.int64)
                return np.array(known, dtype=np.int64)
        ins: list[Any] = [self.const(i) if i else None for i in node.input]
        if op in _UNARY and ins[0] is not None:
            return _UNARY[op](ins[0])
        if op in _ARITH and len(ins) == 2 and ins[0] is not None and ins[1] is not None:
            return _ARITH[op](ins[0], ins[1])
        if ins and ins[0] is None and op not in ("Concat",):
            return None
        if op == "Cast":
            to = _attr(node, "to")
            return ins[0].astype(onnx.helper.tensor_dtype_to_np_dtype(to))
        if op == "Unsqueeze":
            axes = ins[1] if len(ins) > 1 and ins[1] is not None else _attr(node, "axes")
            out = ins[0]
            for ax in sorted(int(a) % (out.ndim + len(axes)) for a in axes):
                out = np.expand_dims(out, ax)
            return out
        if op == "Squeeze":
            axes = ins[1] if len(ins) > 1 and ins[1] is not None else _attr(node, "axes")
            return np.squeeze(ins[0], axis=None if axes is None else tuple(int(a) for a in axes))
        if op == "Reshape" and ins[1] is not None:
            target = [int(d) if d != 0 else ins[0].shape[i] for i, d in enumerate(ins[1])]
            return ins[0].reshape(target)
        if op == "Concat" and all(x is not None for x in ins):
            return np.concatenate(ins, axis=_attr(node, "axis", 0))
        if op == "Gather" and ins[1] is not None:
            return np.take(ins[0], ins[1], axis=_attr(node, "axis", 0))
        if op == "Transpose":
            return np.transpose(ins[0], _attr(node, "perm"))
        return None

    def partial(self, value: str, depth: int = 0) -> list[int | None] | None:
        """A 1-D int vector with unknown entries as None (shape arithmetic), or None."""
        full = self.const(value)
        if full is not None:
            return [int(x) for x in np.asarray(full).reshape(-1)] if full.ndim <= 1 else None
        node = self.producer.get(value)
        if node is None or depth > 12:
            return None
        op = node.op_type
        if op == "Shape":
            shape = self.shape(node.input[0])
            if shape is None:
                return None
            start, end = _attr(node, "start", 0), _attr(node, "end", None)
            return [d if isinstance(d, int) else None for d in shape[start:end]]
        if op == "Concat":
            parts = [self.partial(i, depth + 1) for i in node.input]
            if any(p is None for p in parts):
                return None
            return [x for p in parts for x in p]  # type: ignore[union-attr]
        if op in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
            inner = self.partial(node.input[0], depth + 1)
            if inner is not None and len(inner) <= 1:
                return inner
            return inner if op in ("Cast", "Identity") else None
        if op == "Gather":
            data, idx = self.partial(node.input[0], depth + 1), self.const(node.input[1])
            if data is None or idx is None:
                return None
            return [data[int(i)] for i in np.asarray(idx).reshape(-1)]
        if op == "Slice":
            data = self.partial(node.input[0], depth + 1)
            starts, ends = self.const(node.input[1]), self.const(node.input[2])
            if data is None or starts is None or ends is None:
                return None
            return data[int(starts[0]):int(max(min(ends[0], 2**31), -(2**31)))]
        if op in ("Mul", "Div", "Add", "Sub") and len(node.input) == 2:
            a, b = self.partial(node.input[0], depth + 1), self.partial(node.input[1], depth + 1)
            if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
                return None
            n = max(len(a), len(b))
            a, b = (a * n if len(a) == 1 else a), (b * n if len(b) == 1 else b)
            fn = {"Mul": lambda x, y: x * y, "Div": lambda x, y: x // y,
                  "Add": lambda x, y: x + y, "Sub": lambda x, y: x - y}[op]
            return [None if x is None or y is None else fn(x, y) for x, y in zip(a, b, strict=False)]
        return None

    # ---------------------------------------------------------------- helpers
    def attr(self, node: onnx.NodeProto, name: str, default=None):
        return _attr(node, name, default)

    def in_order(self, names: Iterable[str]) -> tuple[str, ...]:
        """Node names sorted by graph position, deduplicated."""
        return tuple(sorted(set(names), key=lambda n: self.position.get(n, 1 << 30)))
