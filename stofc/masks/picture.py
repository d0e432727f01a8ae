"""Pictures of masks: element level for short sequences, a tile map for long ones.

Element level (``L <= ELEMENT_LIMIT``): allowed positions dark on white, the
outer-tile grid drawn over it, part tiles outlined. Tile map: one cell per
outer tile coloured full / part / empty, with a legend giving the counts.
Both carry a title with the spec and a line with ``L_max``, tile, density and
tile counts. Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from stofc.fsutil import atomic_write
from stofc.masks.decode import tile_classes, to_dense
from stofc.masks.format import MaskFormat

ELEMENT_LIMIT = 1024
COLORS = {"empty": "#f4f4f6", "part": "#f28e2b", "full": "#1f4e79"}
ALLOWED = "#1f4e79"


def _summary(fmt: MaskFormat, head: int) -> tuple[str, dict[str, int], float]:
    cls = tile_classes(fmt, head)
    counts = {"full": int((cls == 2).sum()), "part": int((cls == 1).sum()),
              "empty": int((cls == 0).sum())}
    h = head if fmt.num_heads > 1 else 0
    density = float(fmt.row_nnz[h].sum()) / (fmt.seq_len * fmt.seq_len)
    line = (f"L_max={fmt.seq_len}  tile={fmt.tile}  density={density:.2%}  tiles: "
            f"{counts['full']} full, {counts['part']} part, {counts['empty']} empty")
    return line, counts, density


def render(fmt: MaskFormat, path: str | Path, *, head: int = 0, title: str = "",
           element_limit: int = ELEMENT_LIMIT) -> str:
    """Draw ``fmt`` (one head) to ``path`` (PNG, or any matplotlib format); returns the mode."""
    import matplotlib  # optional: matplotlib, only for pictures

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # optional: matplotlib, only for pictures
    from matplotlib.colors import ListedColormap  # optional: matplotlib, only for pictures
    from matplotlib.patches import Patch, Rectangle  # optional: matplotlib, only for pictures

    L, T = fmt.seq_len, fmt.tile
    info, counts, _ = _summary(fmt, head)
    mode = "tile" if fmt.seq_len > element_limit else "element"
    fig, ax = plt.subplots(figsize=(8.2, 8.8), dpi=130)
    if mode == "element":
        dense = to_dense(fmt, head)
        ax.imshow(dense, cmap=ListedColormap(["#ffffff", ALLOWED]), vmin=0, vmax=1,
                  interpolation="nearest", extent=(-0.5, L - 0.5, L - 0.5, -0.5))
        grid = np.arange(T, L, T) - 0.5
        if len(grid) <= 64:
            for g in grid:
                ax.axhline(g, color="#b0b0b8", lw=0.5)
                ax.axvline(g, color="#b0b0b8", lw=0.5)
        cls = tile_classes(fmt, head)
        if cls.shape[0] <= 64:
            for r, c in zip(*np.nonzero(cls == 1), strict=True):
                w = min(T, L - c * T)
                hgt = min(T, L - r * T)
                ax.add_patch(Rectangle((c * T - 0.5, r * T - 0.5), w, hgt, fill=False,
                                       ec=COLORS["part"], lw=1.2))
        handles = [Patch(fc=ALLOWED, label="allowed"),
                   Patch(fc="#ffffff", ec="#999999", label="masked"),
                   Patch(fc="none", ec=COLORS["part"], lw=1.2,
                         label=f"part tile ({counts['part']})")]
        ax.set_xlim(-0.5, L - 0.5)
        ax.set_ylim(L - 0.5, -0.5)
    else:
        cls = tile_classes(fmt, head)
        R = cls.shape[0]
        cmap = ListedColormap([COLORS["empty"], COLORS["part"], COLORS["full"]])
        ax.imshow(cls, cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
                  extent=(-0.5, L - 0.5, L - 0.5, -0.5))
        handles = [Patch(fc=COLORS["full"], label=f"full tile ({counts['full']})"),
                   Patch(fc=COLORS["part"], label=f"part tile ({counts['part']})"),
                   Patch(fc=COLORS["empty"], ec="#999999", label=f"empty tile ({counts['empty']})")]
        info = f"{info}\n{R} x {R} tiles of {T} x {T} elements; one cell per tile"
    ax.set_xlabel("key position k")
    ax.set_ylabel("query position q")
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3,
              frameon=False, fontsize=9)
    head_text = f"  (head {head} of {fmt.num_heads})" if fmt.num_heads > 1 else ""
    heading = "\n".join(textwrap.wrap(title, 80)[:2]) if title else "mask"
    fig.suptitle(f"{heading}{head_text}", fontsize=11, fontweight="bold", y=0.985)
    ax.set_title(info, fontsize=9, color="#333333", pad=28)
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    path = Path(path)
    kind = path.suffix.lstrip(".").lower() or "png"
    try:
        atomic_write(path, lambda f: fig.savefig(f, format=kind))
    finally:
        plt.close(fig)
    return mode
