"""``stofc verify DIR``: the package against the original model with the structured mask."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from stofc.errors import LimitError, StofcError
from stofc.package.feeds import parse_input_shapes
from stofc.package.verify import END_TO_END_BOUND, verify_package

MAX_VERIFY_TOKENS = 1 << 16  # batch x length of one case (the reference runs in float32 on CPU)


@click.command("verify")
@click.argument("package", type=click.Path(path_type=Path, file_okay=False))
@click.option("--model", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The original model (default: the path recorded at compile time).")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Execution provider that runs the package (the reference always runs on CPU).")
@click.option("--batch", "batches", type=int, multiple=True, metavar="B",
              help="Batch size of a case (repeatable; paired with --seq-len).")
@click.option("--seq-len", "seq_lens", type=int, multiple=True, metavar="L",
              help="Sequence length of a case (repeatable).")
@click.option("--seed", type=int, default=0, show_default=True, help="Input seed.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=D0,D1,...",
              help="The shape of an image/feature input (repeatable); by default from the "
                   "model's static dims, its Conv and position table.")
def verify(package: Path, model: Path | None, provider: str, batches: tuple[int, ...],
           seq_lens: tuple[int, ...], seed: int, as_json: bool,
           input_shapes: tuple[str, ...]) -> None:
    """Run PACKAGE and the original model (structured mask injected) on the same random inputs.

    Reports max abs and relative error per output (relative to the reference's
    max magnitude, at real token positions) and exits 1 when any exceeds 1e-2
    (TARGETS.md). Several lengths, with right padding via the attention mask.
    "mask effect" is the bare original's relative difference from the reference:
    how much the structured mask changes the model's output.
    """
    cases = pair_cases(batches, seq_lens, max_tokens=MAX_VERIFY_TOKENS)
    report = verify_package(package, model=model, provider=provider, cases=cases, seed=seed,
                            bound=END_TO_END_BOUND,
                            input_shapes=parse_input_shapes(input_shapes))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
    else:
        click.echo(f"package   {report.package} ({report.provider})")
        click.echo(f"reference {report.reference} + structured mask (ORT CPU EP, the model's "
                   "own precision)")
        click.echo(f"{'output':<28} {'B':>3} {'L':>6} {'max abs':>10} {'max |ref|':>10} "
                   f"{'rel':>10} {'mask effect':>12}")
        for e in report.errors:
            mark = "" if e.rel <= report.bound else "  FAIL"
            click.echo(f"{e.output[:28]:<28} {e.batch:>3} {e.seq_len:>6} {e.max_abs:>10.3e} "
                       f"{e.max_ref:>10.3e} {e.rel:>10.3e} {e.mask_effect:>12.3e}{mark}")
    if not report.passed:
        w = report.worst
        click.echo(f"verify failed: output {w.output} at (B={w.batch}, L={w.seq_len}) has relative "
                   f"error {w.rel:.3e} > {report.bound:g}", err=True)
        sys.exit(1)
    if not as_json:
        click.echo(f"ok: every output within {report.bound:g} (worst {report.worst.rel:.3e})")


def pair_cases(batches: tuple[int, ...], seq_lens: tuple[int, ...], *,
               max_tokens: int | None = None) -> list[tuple[int, int]] | None:
    """``--batch``/``--seq-len`` pairs; one batch applies to every length. None: defaults.
    ``max_tokens`` bounds ``batch x length`` of each case."""
    if not seq_lens:
        if batches:
            raise StofcError("--batch without --seq-len", hint="give --seq-len L for each case")
        return None
    if any(n < 1 for n in (*batches, *seq_lens)):
        raise StofcError("--batch and --seq-len must be positive", hint="e.g. --batch 2 --seq-len 64")
    if not batches:
        batches = (2,)
    if len(batches) == 1:
        batches = batches * len(seq_lens)
    if len(batches) != len(seq_lens):
        raise StofcError(f"{len(batches)} --batch values for {len(seq_lens)} --seq-len values",
                         hint="give one --batch, or one per --seq-len")
    for b, n in zip(batches, seq_lens, strict=True):
        if max_tokens is not None and b * n > max_tokens:
            raise LimitError(f"--batch {b} x --seq-len {n} is {b * n} tokens, above the "
                             f"{max_tokens} a verify case may run on the CPU",
                             hint="verify with fewer tokens per case (e.g. --batch 2)")
    return list(zip(batches, seq_lens, strict=True))
