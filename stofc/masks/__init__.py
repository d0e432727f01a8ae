"""Attention masks: the MASKS.md spec language, the unified tile format, and its views.

Public API::

    spec = parse_mask("sliding:window=128,causal=true")   # or a .yaml path
    fmt = encode(spec, seq_len, tile=64, layer=0, num_heads=None)  # -> MaskFormat
    dense = to_dense(fmt, head=0)                          # bool [L, L]
    save(fmt, "mask.npz"); fmt = load("mask.npz")          # hash-checked
    stats(fmt)                                             # -> MaskStats
    predicate(spec, L).allowed(q, k)                       # vectorised MASKS.md predicate
"""

from stofc.masks.build import bigbird_random_blocks, build_predicate, predicate
from stofc.masks.cli_form import FAMILIES
from stofc.masks.decode import MaskStats, load, save, stats, tile_classes, to_dense, to_dense_all
from stofc.masks.encoder import TILES, encode
from stofc.masks.format import MaskFormat
from stofc.masks.parse import parse_mask
from stofc.masks.spec import Combine, Family, HeadMasks, MaskSpec, Override

__all__ = [
    "FAMILIES",
    "TILES",
    "Combine",
    "Family",
    "HeadMasks",
    "MaskFormat",
    "MaskSpec",
    "MaskStats",
    "Override",
    "bigbird_random_blocks",
    "build_predicate",
    "encode",
    "load",
    "parse_mask",
    "predicate",
    "save",
    "stats",
    "tile_classes",
    "to_dense",
    "to_dense_all",
]
