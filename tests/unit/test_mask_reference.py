"""An independent, obviously-correct reference of the MASKS.md predicates (tests only).

Masks are plain trees as a user writes them in YAML, e.g.
``{"sliding": {"window": 3, "causal": True}}`` or
``{"union": [...], "causal": True}``; the reference evaluates them by numpy
broadcasting over every ``(q, k)`` of an ``L x L`` grid, straight from the
table in MASKS.md. It shares no code with ``stofc.masks`` except BigBird's
random-block *draw* (``bigbird_random_blocks``), whose own properties are
tested separately.
"""

from __future__ import annotations

import numpy as np

from stofc.masks import bigbird_random_blocks

OPS = ("union", "intersect", "subtract")


def family_dense(name: str, p: dict, L: int, head: int | None = None) -> np.ndarray:
    q = np.arange(L)[:, None]
    k = np.arange(L)[None, :]
    if name == "dense":
        out = np.ones((L, L), dtype=bool)
    elif name == "causal":
        out = k <= q
    elif name == "sliding":
        out = np.abs(q - k) <= p["window"]
    elif name == "global":
        tokens = range(p["first"]) if "first" in p else p["tokens"]
        g = np.isin(np.arange(L), list(tokens))
        out = g[:, None] | g[None, :]
    elif name == "longformer":
        g = np.arange(L) < p["global"]
        out = (np.abs(q - k) <= p["window"]) | g[:, None] | g[None, :]
    elif name == "bigbird":
        b, w, g = p["block"], p["window"], p["global"]
        i, j = q // b, k // b
        out = (np.abs(i - j) <= w // 2) | (i < g) | (j < g)
        rand = bigbird_random_blocks(L, b, w, g, p["random"], p.get("seed", 0))
        nb = rand.shape[0]
        blocks = np.zeros((nb, nb), dtype=bool)
        for row in range(nb):
            for col in rand[row]:
                if col >= 0:
                    blocks[row, col] = True
        out = out | blocks[i, j]
    elif name == "strided":
        s = p["stride"]
        out = (q // s == k // s) | (k % s == s - 1)
    elif name == "dilated":
        out = (np.abs(q - k) <= p["window"]) & ((q - k) % p["dilation"] == 0)
    elif name == "blocksparse":
        layout = np.load(p["layout"])
        if layout.ndim == 3:
            layout = layout[head]
        out = layout[q // p["block"], k // p["block"]]
    elif name == "bitmap":
        m = np.load(p["file"])
        if m.ndim == 3:
            m = m[head]
        out = m[:L, :L].copy()
    else:
        raise AssertionError(name)
    if p.get("causal"):
        out = out & (k <= q)
    return np.broadcast_to(out, (L, L)).copy()


def tree_dense(tree, L: int, head: int | None = None) -> np.ndarray:
    """Evaluate a plain mask tree (YAML form, or a CLI-form string without lists/files)."""
    if isinstance(tree, str):
        name, _, rest = tree.partition(":")
        p = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            p[key] = value == "true" if key == "causal" else int(value)
        return family_dense(name, p, L, head)
    causal = tree.get("causal") is True  # a bool 'causal' is the modifier
    (key,) = [k for k, v in tree.items() if not (k == "causal" and isinstance(v, bool))]
    body = tree[key]
    q = np.arange(L)[:, None]
    k = np.arange(L)[None, :]
    if key in OPS:
        parts = [tree_dense(child, L, head) for child in body]
        if key == "union":
            out = np.logical_or.reduce(parts)
        elif key == "intersect":
            out = np.logical_and.reduce(parts)
        else:
            out = parts[0].copy()
            for other in parts[1:]:
                out &= ~other
    else:
        out = family_dense(key, dict(body or {}), L, head)
    if causal:
        out = out & (k <= q)
    return out


# The reference itself, against masks small enough to write out by hand.


def test_reference_sliding_causal_by_hand():
    got = tree_dense({"sliding": {"window": 1, "causal": True}}, 4)
    want = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=bool)
    assert (got == want).all()


def test_reference_strided_by_hand():
    got = tree_dense("strided:stride=2", 5)
    # q//2 == k//2, or k % 2 == 1 (k = 1, 3)
    want = np.array([[1, 1, 0, 1, 0], [1, 1, 0, 1, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 0],
                     [0, 1, 0, 1, 1]], dtype=bool)
    assert (got == want).all()


def test_reference_subtract_and_global_by_hand():
    got = tree_dense({"subtract": [{"dense": {}}, {"global": {"tokens": [1]}}]}, 3)
    want = np.array([[1, 0, 1], [0, 0, 0], [1, 0, 1]], dtype=bool)
    assert (got == want).all()


def test_reference_dilated_by_hand():
    got = tree_dense("dilated:window=2,dilation=2", 4)
    want = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=bool)
    assert (got == want).all()
