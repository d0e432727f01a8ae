"""``stofc bench DIR``: package vs ORT-optimised original latency (CUDA EP, IOBinding).

The table gives each side's peak device memory per case (``stofc.package.bench``); ORT
failing a long case (out of memory) is ``failed [i]`` with ORT's reason as a footnote.
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
    for i, r in enumerate(_notes(result), start=1):
        if r in result.failures:
            click.echo(f"[{i}] {r.name} at B={r.batch} L={r.seq_len}: ONNX Runtime failed ({r.reason})")
        else:
            click.echo(f"[{i}] {r.name} at B={r.batch} L={r.seq_len}: ONNX Runtime refused "
                       f"CUDA-graph capture ({r.reason}); its plain time is used")
    doc["timings"] = [t.to_dict() for t in result.timings]
    doc["refusals"] = [r.to_dict() for r in result.refusals]
    doc["failures"] = [r.to_dict() for r in result.failures]
    if json_out is not None:
        json_out.write_text(json.dumps(doc, indent=1))
    if plot_path is not None:
        plot(result.timings, plot_path)


def _notes(result: BenchResult) -> list:
    """Failures (plain runs) then CUDA-graph refusals, numbered in this order."""
    return [*result.failures, *result.refusals]


def _table(result: BenchResult, cases: list[tuple[int, int]], *, graph: bool) -> list[dict]:
    """Print one table (plain or CUDA-graph timings) and return its rows for the JSON.

    In the CUDA-graph table a side ORT refused to capture falls back to its plain time,
    marked ``[i]`` (the refusal's footnote) and ``*_graph: false`` in the JSON. A side
    that failed (ORT out of memory at a long length) is ``failed [i]``, its ms None. The
    plain table also gives each side's peak device memory (MiB).
    """
    click.echo(f"{'B':>3} {'L':>6} {'stofc ms':>10} {'ORT opt ms':>11} {'speed-up':>9}"
               + ("" if graph else f" {'stofc MiB':>10} {'ORT MiB':>9}"))
    notes = {(r.name, r.batch, r.seq_len, r in result.failures): i
             for i, r in enumerate(_notes(result), start=1)}
    rows = []
    for b, n in cases:
        cells: list[str] = []
        mems: list[str] = []
        row: dict[str, Any] = {"batch": b, "seq_len": n}
        for name, key in (("stofc", "stofc"), ("ort-optimized", "ort_optimized")):
            t = result.get(name, b, n, graph) or result.get(name, b, n, False)
            if t is None:
                cells.append(f"failed [{notes.get((name, b, n, True), '?')}]")
                row[f"{key}_ms"], row[f"{key}_graph"], row[f"{key}_peak_mib"] = None, False, None
                mems.append("-")
                continue
            mark = f" [{notes[(name, b, n, False)]}]" if graph and (name, b, n, False) in notes \
                else ""
            row[f"{key}_ms"], row[f"{key}_graph"] = t.median_ms, t.graph
            plain = result.get(name, b, n, False)
            row[f"{key}_peak_mib"] = plain.peak_mib if plain else None
            mems.append(f"{row[f'{key}_peak_mib']:.0f}" if row[f"{key}_peak_mib"] is not None
                        else "-")
            cells.append(f"{t.median_ms:.3f}{mark}")
        both = row["stofc_ms"] is not None and row["ort_optimized_ms"] is not None
        row["speedup"] = row["ort_optimized_ms"] / row["stofc_ms"] if both else None
        rows.append(row)
        speed = f"{row['speedup']:>8.2f}x" if both else f"{'-':>9}"
        click.echo(f"{b:>3} {n:>6} {cells[0]:>10} {cells[1]:>11} {speed}"
                   + ("" if graph else f" {mems[0]:>10} {mems[1]:>9}"))
    return rows
