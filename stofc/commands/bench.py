"""``stofc bench DIR``: package vs ORT-optimised original latency (CUDA EP, IOBinding).

``--cuda-graph`` adds a second table: both sides replayed as ONNX Runtime CUDA graphs
(``stofc.package.bench``), with ORT's refusals named in footnotes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from stofc.commands.verify import pair_cases
from stofc.errors import StofcError
from stofc.package.bench import BenchResult, bench_package, plot


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
@click.option("--cuda-graph", is_flag=True,
              help="Also time both sides as ONNX Runtime CUDA-graph replays (one session per "
                   "shape); at small shapes a plain session is bound by launch overhead.")
def bench(package: Path, model: Path | None, batches: tuple[int, ...], seq_lens: tuple[int, ...],
          warmup: int, repeat: int, json_out: Path | None, plot_path: Path | None,
          cuda_graph: bool) -> None:
    """Time PACKAGE against the original optimised by ORT's transformer optimizer (GPU only)."""
    if warmup < 0 or repeat < 3:
        raise StofcError("--warmup must be >= 0 and --repeat >= 3", hint="e.g. --repeat 50")
    cases = pair_cases(batches, seq_lens) or [(1, 128)]
    result = bench_package(package, model=model, cases=cases, warmup=warmup, repeat=repeat,
                           cuda_graph=cuda_graph)
    doc: dict = {"package": str(package), "summary": _table(result, cases, graph=False)}
    if cuda_graph:
        click.echo("\nCUDA graphs (enable_cuda_graph, one session per shape):")
        doc["cuda_graph"] = _table(result, cases, graph=True)
        for i, r in enumerate(result.refusals, start=1):
            click.echo(f"[{i}] {r.name} at B={r.batch} L={r.seq_len}: ONNX Runtime refused "
                       f"CUDA-graph capture ({r.reason}); its plain time is used")
    doc["timings"] = [t.to_dict() for t in result.timings]
    doc["refusals"] = [r.to_dict() for r in result.refusals]
    if json_out is not None:
        json_out.write_text(json.dumps(doc, indent=1))
    if plot_path is not None:
        plot(result.timings, plot_path)


def _table(result: BenchResult, cases: list[tuple[int, int]], *, graph: bool) -> list[dict]:
    """Print one table (plain or CUDA-graph timings) and return its rows for the JSON.

    In the CUDA-graph table a side ORT refused to capture falls back to its plain time,
    marked ``[i]`` (the refusal's footnote) and ``*_graph: false`` in the JSON.
    """
    click.echo(f"{'B':>3} {'L':>6} {'stofc ms':>10} {'ORT opt ms':>11} {'speed-up':>9}")
    refused = {(r.name, r.batch, r.seq_len): i for i, r in enumerate(result.refusals, start=1)}
    rows = []
    for b, n in cases:
        cells: list[str] = []
        row: dict[str, Any] = {"batch": b, "seq_len": n}
        for name, key in (("stofc", "stofc"), ("ort-optimized", "ort_optimized")):
            t = result.get(name, b, n, graph) or result.get(name, b, n, False)
            if t is None:
                raise StofcError(f"no {name} timing at batch {b}, length {n}",
                                 hint="this is a stofc bug; report it")
            mark = f" [{refused[(name, b, n)]}]" if graph and (name, b, n) in refused else ""
            row[f"{key}_ms"], row[f"{key}_graph"] = t.median_ms, t.graph
            cells.append(f"{t.median_ms:.3f}{mark}")
        row["speedup"] = row["ort_optimized_ms"] / row["stofc_ms"]
        rows.append(row)
        click.echo(f"{b:>3} {n:>6} {cells[0]:>10} {cells[1]:>11} {row['speedup']:>8.2f}x")
    return rows
