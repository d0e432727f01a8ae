"""The masks stage of the road: one encoded format per attention layer, before planning.

:func:`encode_layers` resolves the (effective) spec for every layer and head count
and encodes it (:func:`stofc.masks.encode`); layers whose masks resolve alike share
one :class:`~stofc.masks.format.MaskFormat` object. The result,
:class:`LayerMasks`, is what the planner selects attention kernels on and what the
package stores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from stofc.masks.encoder import encode
from stofc.masks.format import MaskFormat
from stofc.masks.spec import MaskSpec


@dataclass(frozen=True, eq=False)
class LayerMasks:
    """The effective mask spec and the format of every attention layer (by layer index).

    ``plan_id`` is what :class:`~stofc.plan.plan.Plan` records as its ``mask``.
    """

    formats: Mapping[int, MaskFormat]
    plan_id: str

    def __getitem__(self, layer: int) -> MaskFormat:
        return self.formats[layer]

    def distinct(self) -> tuple[MaskFormat, ...]:
        """Each format once, in layer order."""
        seen: dict[str, MaskFormat] = {}
        for _, fmt in sorted(self.formats.items()):
            seen.setdefault(fmt.spec_hash, fmt)
        return tuple(seen.values())


def plan_id(canonical: str) -> str:
    """The plan's record of the effective masks: sha256 of their canonical JSON."""
    return hashlib.sha256(canonical.encode()).hexdigest()


def encode_layers(spec: MaskSpec | Mapping[int, MaskSpec], heads: Mapping[int, int],
                  max_seq_len: int, tile: int, *, plan_id: str) -> LayerMasks:
    """One format per layer of ``heads`` (layer index -> attention heads), for ``L_max``
    = ``max_seq_len`` and outer tile ``tile``, of ``spec`` (one for every layer, or one
    per layer); equal layers share the object."""
    formats: dict[int, MaskFormat] = {}
    seen: dict[str, MaskFormat] = {}
    for layer, num_heads in heads.items():
        layer_spec = spec if isinstance(spec, MaskSpec) else spec[layer]
        fmt = encode(layer_spec, max_seq_len, tile=tile, layer=layer, num_heads=num_heads)
        formats[layer] = seen.setdefault(fmt.spec_hash, fmt)
    return LayerMasks(formats, plan_id)


def as_layer_masks(masks: LayerMasks | MaskFormat | Mapping[int, MaskFormat] | None,
                   layers: tuple[int, ...]) -> LayerMasks | None:
    """``masks`` as :class:`LayerMasks`: one format for every layer, a mapping, or None."""
    if masks is None or isinstance(masks, LayerMasks):
        return masks
    if isinstance(masks, MaskFormat):
        return LayerMasks(dict.fromkeys(layers, masks), masks.spec_hash)
    ids = "|".join(masks[k].spec_hash for k in sorted(masks))
    return LayerMasks(dict(masks), hashlib.sha256(ids.encode()).hexdigest())
