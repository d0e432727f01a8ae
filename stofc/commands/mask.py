"""``stofc mask``: look at, measure, export and encode attention masks."""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from stofc.errors import MaskSpecError
from stofc.fsutil import atomic_write
from stofc.kernels.attention import select_kernel
from stofc.masks import encode, parse_mask, save, stats
from stofc.masks.decode import DENSE_LIMIT, to_dense_all
from stofc.masks.limits import check_dense
from stofc.masks.picture import render
from stofc.targets import get_profile


def _spec_options(fn):
    # Plain ints: stofc validates them itself so that a bad value is one line, exit 2.
    fn = click.option("--num-heads", type=int, default=None,
                      help="Heads of the model (needed for per-head specs).")(fn)
    fn = click.option("--layer", type=int, default=0, show_default=True,
                      help="Layer whose overrides apply.")(fn)
    fn = click.option("--tile", type=int, default=64, show_default=True,
                      help="Outer tile size: 16, 32, 64 or 128.")(fn)
    fn = click.option("--seq-len", "-L", type=int, required=True,
                      help="Maximum sequence length L_max.")(fn)
    return click.argument("spec")(fn)


def _encode(spec_text: str, seq_len: int, tile: int, layer: int, num_heads: int | None):
    if layer < 0:
        raise MaskSpecError(f"--layer {layer} is negative", hint="accepted: an integer >= 0")
    if num_heads is not None and num_heads < 1:
        raise MaskSpecError(f"--num-heads {num_heads} is invalid",
                            hint="accepted: an integer >= 1")
    spec = parse_mask(spec_text)
    if num_heads is None and spec.is_per_head(layer) and spec.file_heads(layer) is None:
        raise MaskSpecError(f"mask '{spec_text}' differs per head",
                            hint="pass --num-heads H (the model's attention heads)")
    return encode(spec, seq_len, tile=tile, layer=layer, num_heads=num_heads)


def select_for(fmt, gpu: str, *, batch: int, heads: int, head_dim: int) -> dict:
    """The attention kernel the selector chooses for ``fmt`` on ``gpu`` at ``seq_len =
    L_max`` (:func:`stofc.kernels.attention.select_kernel`), with its explanation."""
    choice = select_kernel(fmt, get_profile(gpu), batch=batch, heads=heads,
                           seq_len=fmt.seq_len, head_dim=head_dim)
    return {"gpu": gpu, "batch": batch, "heads": heads, "head_dim": head_dim,
            "kernel": str(choice.kernel), "explanation": str(choice.explanation)}


@click.group("mask")
def mask() -> None:
    """Inspect attention masks and their tile format.

    SPEC is NAME[:key=value,...] or a .yaml file (design/MASKS.md), e.g.

    \b
      causal
      sliding:window=128,causal=true
      longformer:window=256,global=2
      bigbird:block=64,window=3,global=2,random=3,seed=0
      global:tokens=[0,17,255]
      blocksparse:layout=layout.npy,block=64
    """


@mask.command("show")
@_spec_options
@click.option("--head", type=int, default=0, show_default=True,
              help="Head to draw (per-head specs).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help="Picture to write (.png, .svg, .pdf).")
def show(spec: str, seq_len: int, tile: int, layer: int, num_heads: int | None, head: int,
         output: str) -> None:
    """Draw SPEC: every element for L <= 1024, else a map of full/part/empty tiles."""

    suffix = Path(output).suffix.lower()
    if suffix not in (".png", ".svg", ".pdf"):
        raise MaskSpecError(f"cannot write a picture to '{output}'",
                            hint="accepted extensions: .png, .svg, .pdf")
    fmt = _encode(spec, seq_len, tile, layer, num_heads)
    if head < 0 or (fmt.num_heads > 1 and head >= fmt.num_heads):
        raise MaskSpecError(f"--head {head} is out of range for {fmt.num_heads} heads",
                            hint=f"accepted: 0-{max(fmt.num_heads, 1) - 1}")
    title = spec if not layer else f"{spec}  (layer {layer})"
    mode = render(fmt, output, head=head, title=title)
    click.echo(f"wrote {output} ({'elements' if mode == 'element' else 'tile map'}, "
               f"L_max={seq_len}, tile={tile})")


@mask.command("stats")
@_spec_options
@click.option("--gpu", default="h100", show_default=True,
              help="GPU profile for the kernel selector.")
@click.option("--batch", type=int, default=1, show_default=True,
              help="Batch size for the kernel selector.")
@click.option("--head-dim", type=int, default=64, show_default=True,
              help="Head dimension for the kernel selector.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def stats_cmd(spec: str, seq_len: int, tile: int, layer: int, num_heads: int | None, gpu: str,
              batch: int, head_dim: int, as_json: bool) -> None:
    """Density, tiles full/part/empty, bitmap and format bytes, kernel choice."""

    if batch < 1 or head_dim < 1:
        raise MaskSpecError(f"--batch {batch} / --head-dim {head_dim} must be >= 1",
                            hint="accepted: positive integers")
    fmt = _encode(spec, seq_len, tile, layer, num_heads)
    st = stats(fmt)
    heads = num_heads or (fmt.num_heads if fmt.num_heads > 1 else 12)
    selected = select_for(fmt, gpu, batch=batch, heads=heads, head_dim=head_dim)
    if as_json:
        out = st.to_json()
        out["spec"] = json.loads(fmt.spec)
        out["spec_hash"] = fmt.spec_hash
        out["selector"] = selected
        click.echo(json.dumps(out, indent=1, sort_keys=True))
        return
    total = st.tiles_full + st.tiles_part + st.tiles_empty
    rows = [
        ("spec", spec),
        ("L_max / tile", f"{st.seq_len} / {st.tile}  ({fmt.tile_rows} x {fmt.tile_rows} tiles"
                         f"{f', {st.num_heads} heads' if st.num_heads > 1 else ''})"),
        ("density", f"{st.density:.4%}  ({st.nnz} allowed elements)"),
        ("tiles full", f"{st.tiles_full}  ({st.tiles_full / total:.2%})"),
        ("tiles part", f"{st.tiles_part}  ({st.tiles_part / total:.2%})"),
        ("tiles empty", f"{st.tiles_empty}  ({st.tiles_empty / total:.2%})"),
        ("tiles per tile row", f"max {st.row_tiles_max}, mean {st.row_tiles_mean:.1f}"),
        ("16x16 blocks non-empty", str(st.blocks16_nonempty)),
        ("bitmap bytes", f"{st.bitmap_bytes}"),
        ("format bytes", f"{st.format_bytes}"),
        ("spec hash", fmt.spec_hash[:16]),
    ]
    if selected is None:
        rows.append(("kernel", "(selector not available yet: "
                               "stofc.kernels.attention.select_kernel)"))
    else:
        rows.append((f"kernel ({gpu}, batch {batch}, {heads} heads, D={head_dim})",
                     selected["kernel"]))
        if selected["explanation"]:
            rows.append(("why", selected["explanation"]))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


@mask.command("export")
@_spec_options
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help="The .npy file to write.")
def export(spec: str, seq_len: int, tile: int, layer: int, num_heads: int | None,
           output: str) -> None:
    """Write the dense bool mask [L, L] (or [H, L, L] per head) to a .npy file."""

    if seq_len > DENSE_LIMIT:
        raise MaskSpecError(f"--seq-len {seq_len} is too large to export densely",
                            hint=f"accepted: at most {DENSE_LIMIT}; use 'stofc mask encode'")
    if not output.endswith(".npy"):
        raise MaskSpecError(f"cannot export to '{output}'", hint="accepted: a .npy path")
    check_dense(seq_len, num_heads or 1)  # before encoding: the dense array is the big part
    fmt = _encode(spec, seq_len, tile, layer, num_heads)
    check_dense(seq_len, fmt.num_heads)
    dense = to_dense_all(fmt)
    atomic_write(output, lambda f: np.save(f, dense))
    click.echo(f"wrote {output} (bool {list(dense.shape)}, {int(dense.sum())} allowed)")


@mask.command("encode")
@_spec_options
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help="The .npz file to write.")
def encode_cmd(spec: str, seq_len: int, tile: int, layer: int, num_heads: int | None,
               output: str) -> None:
    """Write the unified tile format (.npz, with the canonical spec and its hash)."""

    if not output.endswith(".npz"):
        raise MaskSpecError(f"cannot write the format to '{output}'",
                            hint="accepted: a .npz path")
    fmt = _encode(spec, seq_len, tile, layer, num_heads)
    save(fmt, output)
    click.echo(f"wrote {output} ({len(fmt.full_col_idx)} full + {len(fmt.part_col_idx)} part "
               f"tiles, hash {fmt.spec_hash[:16]})")
