"""Mask specs as data: family and composition nodes, per-layer and per-head overrides.

A spec is a tree of :class:`Family` leaves and :class:`Combine` nodes
(``union`` / ``intersect`` / ``subtract``), each with an optional ``causal``
modifier (AND with ``k <= q``). :class:`MaskSpec` adds the per-layer and
per-head overrides of a YAML file. Everything here is frozen and hashable; the
canonical JSON form (sorted keys, no whitespace) names a spec on every machine:
file-backed families (``blocksparse``, ``bitmap``) are named by the sha256 and
shape of their array, never by their path.

Override precedence (documented contract): for layer ``l`` and head ``h`` the
mask is the ``heads`` override covering ``h`` if any, else the ``layers``
override covering ``l`` if any, else the default ``mask``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from stofc.errors import MaskSpecError

COMBINE_OPS = ("union", "intersect", "subtract")


@dataclass(frozen=True)
class ArrayRef:
    """A boolean array read from a ``.npy`` file, named by content (sha256 and shape).

    ``head`` selects one slice of a per-head array (``[H, N, N]``); ``None``
    means the whole array (shared when 2-D).
    """

    sha256: str
    shape: tuple[int, ...]
    path: str = field(compare=False)
    data: np.ndarray = field(compare=False, repr=False)
    head: int | None = None

    @property
    def num_heads(self) -> int | None:
        """``H`` for a per-head array, ``None`` for a shared ``[N, N]`` one."""
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def array(self) -> np.ndarray:
        """The 2-D boolean array this reference denotes (a read-only view)."""
        if len(self.shape) == 2:
            return self.data
        if self.head is None:
            raise MaskSpecError(f"per-head array {self.path} used without a head index",
                                hint="encode with num_heads set")
        return self.data[self.head]

    def canonical(self) -> dict:
        out: dict = {"sha256": self.sha256, "shape": list(self.shape)}
        if self.head is not None:
            out["head"] = self.head
        return out


ParamValue = int | tuple[int, ...] | ArrayRef


@dataclass(frozen=True)
class Family:
    """One mask family of MASKS.md with validated parameters (sorted by name)."""

    name: str
    params: tuple[tuple[str, ParamValue], ...]
    causal: bool = False

    def get(self, key: str, default: ParamValue | None = None) -> ParamValue | None:
        for k, v in self.params:
            if k == key:
                return v
        return default

    def canonical(self) -> dict:
        body: dict = {}
        for k, v in self.params:
            if isinstance(v, ArrayRef):
                body[k] = v.canonical()
            elif isinstance(v, tuple):
                body[k] = list(v)
            else:
                body[k] = v
        if self.causal:
            body["causal"] = True
        return {self.name: body}


@dataclass(frozen=True)
class Combine:
    """``union`` / ``intersect`` / ``subtract`` (first minus the union of the rest)."""

    op: str
    children: tuple[Node, ...]
    causal: bool = False

    def canonical(self) -> dict:
        out: dict = {self.op: [c.canonical() for c in self.children]}
        if self.causal:
            out["causal"] = True
        return out


Node = Family | Combine


def canonical_json(obj: object) -> str:
    """Canonical JSON text: sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _arrays(node: Node):
    """Every ArrayRef in a node tree (depth first)."""
    if isinstance(node, Family):
        for _, v in node.params:
            if isinstance(v, ArrayRef):
                yield v
    else:
        for child in node.children:
            yield from _arrays(child)


def spec_files(spec: MaskSpec) -> tuple[Path, ...]:
    """The files a spec was read from: its YAML file and every layout or bitmap array."""
    nodes = (spec.default, *(o.node for o in (*spec.layers, *spec.heads)))
    files = [Path(a.path) for n in nodes for a in _arrays(n)]
    if spec.source.lower().endswith((".yaml", ".yml")):
        files.append(Path(spec.source))
    return tuple(dict.fromkeys(files))


def file_heads(node: Node) -> int | None:
    """``H`` of the per-head arrays a node uses (all must agree), else ``None``."""
    heads = {a.num_heads for a in _arrays(node) if a.num_heads is not None}
    if len(heads) > 1:
        raise MaskSpecError(f"per-head files disagree on the number of heads: {sorted(heads)}",
                            hint="give every per-head layout or bitmap the same H")
    return heads.pop() if heads else None


def select_head(node: Node, head: int) -> Node:
    """The node with every per-head array narrowed to ``head``."""
    if isinstance(node, Family):
        params = tuple((k, replace(v, head=head) if isinstance(v, ArrayRef)
                        and v.num_heads is not None else v) for k, v in node.params)
        return replace(node, params=params)
    return replace(node, children=tuple(select_head(c, head) for c in node.children))


@dataclass(frozen=True)
class Override:
    """A node that replaces the default for layers or heads ``lo..hi`` (inclusive)."""

    lo: int
    hi: int
    node: Node

    def covers(self, index: int) -> bool:
        return self.lo <= index <= self.hi

    @property
    def key(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


@dataclass(frozen=True)
class HeadMasks:
    """The masks of one layer: one node (shared by every head) or one per head."""

    heads: tuple[Node, ...]

    @property
    def shared(self) -> bool:
        return len(self.heads) == 1

    @property
    def num_heads(self) -> int:
        """1 when shared, else ``H`` (the ``MaskFormat.num_heads`` convention)."""
        return len(self.heads)

    def canonical(self) -> str:
        if self.shared:
            return canonical_json({"mask": self.heads[0].canonical()})
        return canonical_json({"heads": [n.canonical() for n in self.heads]})


@dataclass(frozen=True)
class MaskSpec:
    """A parsed, validated mask spec (see ``stofc.masks.parse_mask``)."""

    default: Node
    layers: tuple[Override, ...] = ()
    heads: tuple[Override, ...] = ()
    source: str = field(default="", compare=False)

    def canonical(self) -> str:
        """Canonical JSON text of the whole spec (machine- and path-independent)."""
        obj: dict = {"mask": self.default.canonical()}
        if self.layers:
            obj["layers"] = {o.key: o.node.canonical() for o in self.layers}
        if self.heads:
            obj["heads"] = {o.key: o.node.canonical() for o in self.heads}
        return canonical_json(obj)

    @property
    def hash(self) -> str:
        """sha256 hex of :meth:`canonical`."""
        return sha256_text(self.canonical())

    def layer_node(self, layer: int) -> Node:
        """The node for ``layer`` before head overrides."""
        for o in self.layers:
            if o.covers(layer):
                return o.node
        return self.default

    def check_layers(self, num_layers: int) -> None:
        """Every ``layers`` override names layers the model has (``0 .. num_layers - 1``);
        an override past the last layer is a mistake (a typo, or the wrong model), never
        silently ignored."""
        for o in self.layers:
            if o.hi >= num_layers:
                noun = "layer" if num_layers == 1 else "layers"
                raise MaskSpecError(f"layer override '{o.key}' is out of range: the model has "
                                    f"{num_layers} attention {noun}",
                                    hint=f"use layer indices 0-{num_layers - 1}")

    def file_heads(self, layer: int = 0) -> int | None:
        """``H`` of the per-head files used by ``layer`` or any head override."""
        found = {h for h in (file_heads(self.layer_node(layer)),
                             *(file_heads(o.node) for o in self.heads)) if h is not None}
        if len(found) > 1:
            raise MaskSpecError(f"per-head files disagree on the number of heads: {sorted(found)}",
                                hint="give every per-head layout or bitmap the same H")
        return found.pop() if found else None

    def is_per_head(self, layer: int = 0) -> bool:
        """True when heads of ``layer`` may differ (head overrides or per-head files)."""
        return bool(self.heads) or self.file_heads(layer) is not None

    def for_layer(self, layer: int = 0, num_heads: int | None = None) -> HeadMasks:
        """Resolve overrides for ``layer``: one node when every head shares it.

        A per-head spec needs ``num_heads`` (or takes ``H`` from its per-head
        files). Heads that all resolve to the same node collapse to one shared
        node (``MaskFormat.num_heads == 1``).
        """
        base = self.layer_node(layer)
        if not self.is_per_head(layer):
            return HeadMasks((base,))
        fh = self.file_heads(layer)
        if num_heads is None:
            num_heads = fh
        if num_heads is None:
            raise MaskSpecError("this mask has per-head overrides, so the number of heads is needed",
                                hint="pass num_heads (the model's attention heads)")
        if num_heads < 1:
            raise MaskSpecError(f"num_heads must be >= 1, got {num_heads}")
        if fh is not None and fh != num_heads:
            raise MaskSpecError(f"per-head mask files have {fh} heads but the model has {num_heads}",
                                hint=f"give layout/bitmap arrays of shape [{num_heads}, N, N]")
        for o in self.heads:
            if o.hi >= num_heads:
                raise MaskSpecError(f"head override '{o.key}' is out of range for {num_heads} heads",
                                    hint=f"use head indices 0-{num_heads - 1}")
        nodes = []
        for h in range(num_heads):
            node = next((o.node for o in self.heads if o.covers(h)), base)
            nodes.append(select_head(node, h) if fh is not None else node)
        if all(n == nodes[0] for n in nodes):
            return HeadMasks((nodes[0],))
        return HeadMasks(tuple(nodes))
