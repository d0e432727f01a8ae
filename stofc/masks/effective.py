"""The mask a package compiles per layer: the model's own mask AND the user's spec.

``stofc compile --mask model`` (the default) compiles exactly what the model computes
(:mod:`stofc.frontend.model_mask`); a user's ``--mask SPEC`` is *intersected* with it,
never substituted for it: a structured mask can only remove keys the model allows.
The result is one :class:`~stofc.masks.spec.MaskSpec` per layer (the user's per-head
overrides keep their heads, each ANDed with the layer's own mask), encoded one format
per layer (:func:`stofc.pipeline.encode_masks`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from stofc.masks.spec import Combine, Family, MaskSpec, Node, Override, canonical_json

MODEL = "model"   # the --mask value that means: the model's own mask only


def _dense(node: Node) -> bool:
    return isinstance(node, Family) and node.name == "dense" and not node.causal


def intersect(model: Node, user: Node | None) -> Node:
    """``model AND user`` (either side left out when it allows everything)."""
    if user is None or _dense(user):
        return model
    if _dense(model):
        return user
    if model == user:
        return model
    return Combine("intersect", (model, user))


def effective_specs(own: dict[int, Node], user: MaskSpec | None,
                    layers: Iterable[int]) -> dict[int, MaskSpec]:
    """Per layer: the model's node ``own[layer]`` AND the user's spec for that layer."""
    out: dict[int, MaskSpec] = {}
    for layer in layers:
        model = own[layer]
        if user is None:
            out[layer] = MaskSpec(default=model, source=MODEL)
            continue
        heads = tuple(Override(o.lo, o.hi, intersect(model, o.node)) for o in user.heads)
        out[layer] = MaskSpec(default=intersect(model, user.layer_node(layer)), heads=heads,
                              source=user.source)
    return out


def effective_canonical(specs: dict[int, MaskSpec]) -> str:
    """Canonical JSON of the per-layer specs: one spec when every layer has the same,
    else ``{"layers": {"0": spec, ...}}``."""
    texts = {layer: spec.canonical() for layer, spec in specs.items()}
    if len(set(texts.values())) <= 1:
        return next(iter(texts.values()), canonical_json({"mask": {"dense": {}}}))
    return canonical_json({"layers": {str(k): json.loads(v) for k, v in sorted(texts.items())}})
