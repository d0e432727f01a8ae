"""The shape of each graph input for ``stofc verify``'s random feeds.

A symbolic dimension of a token input is the batch (first) or the sequence
length (second). Image and feature inputs (float, rank >= 3) are not sequences:
(float inputs of rank >= 4, or read by a Conv; a float ``[B, S, hidden]`` input is a
sequence) their dims come, in this order, from ``--input-shape NAME=D0,D1,...``, the
model's static dims, and the model itself (the channels of the Conv that reads
the input; the side from the position-embedding table: ``(side / stride)^2``
patches, plus one class token or not). When none of these tells a dimension,
the error says which input and how to pass it.
"""

from __future__ import annotations

import math

import numpy as np

from stofc.errors import StofcError
from stofc.frontend.graph import GraphIndex
from stofc.frontend.types import ModelGraph, ValueInfo


def parse_input_shapes(items: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """``("pixel_values=2,3,224,224", ...)`` -> ``{"pixel_values": (2, 3, 224, 224)}``."""
    out = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            shape = ()
        if not name or not shape or any(d < 1 for d in shape):
            raise StofcError(f"--input-shape {item!r} is not NAME=D0,D1,... with positive dims",
                             hint="e.g. --input-shape pixel_values=2,3,224,224")
        out[name] = shape
    return out


def input_shape(graph: ModelGraph, idx: GraphIndex, vi: ValueInfo, batch: int, seq_len: int,
                given: dict[str, tuple[int, ...]]) -> list[int]:
    """The concrete shape of graph input ``vi`` (module doc)."""
    if vi.name in given:
        shape = list(given[vi.name])
        if len(shape) != len(vi.shape) or any(isinstance(d, int) and d > 0 and d != s
                                               for d, s in zip(vi.shape, shape, strict=False)):
            raise StofcError(f"--input-shape {vi.name}={','.join(map(str, shape))} does not "
                             f"fit the model's {list(vi.shape)}",
                             hint="give every dimension, matching the static ones")
        return shape
    image = np.issubdtype(np.dtype(vi.dtype), np.floating) and (
        len(vi.shape) >= 4 or any(u.op_type == "Conv" for u in idx.users(vi.name)))
    if not image:
        symbols: dict[str, int] = {}
        shape = []
        for d in vi.shape:
            if isinstance(d, int) and d > 0:
                shape.append(d)
            else:
                key = str(d)
                if key not in symbols:
                    symbols[key] = (batch, seq_len)[min(len(symbols), 1)]
                shape.append(symbols[key])
        return shape
    dims: list[int | None] = [d if isinstance(d, int) and d > 0 else None for d in vi.shape]
    if dims[0] is None:
        dims[0] = batch
    conv = next((u for u in idx.users(vi.name) if u.op_type == "Conv"), None)
    if conv is not None:
        weight = idx.shape(conv.input[1]) or ()
        if dims[1] is None and len(weight) >= 2 and isinstance(weight[1], int):
            dims[1] = weight[1]
        side = _side(idx, conv)
        for i in range(2, len(dims)):
            if dims[i] is None and side is not None:
                dims[i] = side
    if any(d is None for d in dims):
        raise StofcError(f"cannot tell the shape of input {vi.name!r} ({list(vi.shape)}): it is "
                         "not a token sequence", hint=f"pass --input-shape {vi.name}=" +
                         ",".join(str(d) if d is not None else "N" for d in dims))
    return [int(d) for d in dims if d is not None]


def _side(idx: GraphIndex, conv) -> int | None:
    """The image side whose patches fill the position-embedding table (ViT, CLIP)."""
    strides = idx.attr(conv, "strides", None)
    kernel = idx.shape(conv.input[1]) or ()
    stride = int(strides[0]) if strides else (
        int(kernel[2]) if len(kernel) > 2 and isinstance(kernel[2], int) else None)
    hidden = kernel[0] if kernel else None
    if not stride or not isinstance(hidden, int):
        return None
    for init in idx.initializers.values():
        readers = idx.users(init.name)
        if not any(u.op_type == "Add" or (u.op_type == "Gather" and u.input[0] == init.name)
                   for u in readers):
            continue  # a position table is gathered or added, never multiplied
        dims = [int(d) for d in init.dims]
        if len(dims) in (2, 3) and dims[-1] == hidden and (len(dims) == 2 or dims[0] == 1):
            rows = dims[-2]
            for tokens in (rows - 1, rows):
                n = math.isqrt(max(tokens, 0))
                if tokens > 0 and n * n == tokens:
                    return n * stride
    return None
