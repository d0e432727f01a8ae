"""``stofc bench DIR``: package vs ORT-optimised original latency (CUDA EP, IOBinding)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from stofc.commands.verify import pair_cases
from stofc.errors import StofcError
from stofc.package.bench import bench_package, plot


@click.command("bench")
@click.argument("package", type=click.Path(path_type=Path, file_okay=False))
@click.option("--model", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The original model (default: the path recorded at compile time).")
@click.option("--batch", "batches", type=int, multiple=True, metavar="B",
              help="Batch size of a case (repeatable; paired with --seq-len).")
@click.option("--seq-len", "seq_lens", type=int, multiple=True, metavar="L",
              help="Sequence length of a case (repeatable).")
@click.option("--warmup", type=int, default=10, show_default=True, help="Untimed runs per case.")
@click.option("--repeat", type=int, default=50, show_default=True, help="Timed runs per case.")
@click.option("--json-out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write the results as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path, dir_okay=False),
              default=None, help="Write a PNG bar chart here.")
def bench(package: Path, model: Path | None, batches: tuple[int, ...], seq_lens: tuple[int, ...],
          warmup: int, repeat: int, json_out: Path | None, plot_path: Path | None) -> None:
    """Time PACKAGE against the original optimised by ORT's transformer optimizer (GPU only)."""
    if warmup < 0 or repeat < 3:
        raise StofcError("--warmup must be >= 0 and --repeat >= 3", hint="e.g. --repeat 50")
    cases = pair_cases(batches, seq_lens) or [(1, 128)]
    results = bench_package(package, model=model, cases=cases, warmup=warmup, repeat=repeat)
    click.echo(f"{'B':>3} {'L':>6} {'stofc ms':>10} {'ORT opt ms':>11} {'speed-up':>9}")
    rows = []
    for b, n in cases:
        mine = next(t for t in results if t.name == "stofc" and (t.batch, t.seq_len) == (b, n))
        base = next(t for t in results if t.name != "stofc" and (t.batch, t.seq_len) == (b, n))
        speed = base.median_ms / mine.median_ms
        rows.append({"batch": b, "seq_len": n, "stofc_ms": mine.median_ms,
                     "ort_optimized_ms": base.median_ms, "speedup": speed})
        click.echo(f"{b:>3} {n:>6} {mine.median_ms:>10.3f} {base.median_ms:>11.3f} {speed:>8.2f}x")
    if json_out is not None:
        json_out.write_text(json.dumps({"package": str(package), "summary": rows,
                                        "timings": [t.to_dict() for t in results]}, indent=1))
    if plot_path is not None:
        plot(results, plot_path)
