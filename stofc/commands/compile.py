"""``stofc compile MODEL --mask SPEC``: argument checks, then :func:`stofc.pipeline.compile_model`."""

from __future__ import annotations

from pathlib import Path

import click

from stofc.commands.tune import choose_reporter
from stofc.errors import StofcError
from stofc.masks.limits import MAX_SEQ_LEN
from stofc.pipeline import DEFAULT_GPU, DEFAULT_MAX_SEQ_LEN, Instruments, compile_model


@click.command("compile")
@click.argument("model", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--mask", "mask", default="model", show_default=True, metavar="SPEC",
              help="Structured attention mask: NAME[:key=value,...] or a .yaml file (MASKS.md), "
                   "ANDed with the mask the model computes itself (causal, sliding windows, "
                   "local layers); 'model' compiles the model's own mask alone.")
@click.option("--gpu", default=DEFAULT_GPU, show_default=True, metavar="NAME",
              help="Target GPU profile (a100, h100, h200, ...; auto = the GPU present). "
                   "Kernels are compiled for its arch (cubin) plus PTX; no GPU is needed. "
                   "Default h100: its sm_90 cubins also run on an H200.")
@click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True,
              help="Data type of the fused ops (graph inputs and outputs keep theirs).")
@click.option("--max-seq-len", "max_seq_len", type=int, default=None, metavar="N",
              help=f"Longest sequence the package accepts (L_max; at most {MAX_SEQ_LEN}). "
                   f"Default {DEFAULT_MAX_SEQ_LEN}, or the model's position table when shorter; "
                   "longer than that table is refused.")
@click.option("--batch", type=int, default=1, show_default=True,
              help="Batch size the analytical configs are chosen for (any batch runs).")
@click.option("-o", "--output", "out_dir", type=click.Path(path_type=Path, file_okay=False),
              default=None, help="Package directory (default: <model stem>.stofc beside MODEL).")
@click.option("--tune", is_flag=True,
              help="Then tune the package on the GPU present (must be --gpu).")
@click.option("--budget", type=float, default=None, metavar="SECONDS",
              help="With --tune: stop tuning after this many seconds.")
@click.option("--seq-len", "seq_lens", type=int, multiple=True, metavar="L",
              help="A sequence-length bucket (repeatable): the attention kernel is also "
                   "chosen for runs up to L, and the package switches to it at run time. "
                   "Default 128, 512, 2048, 8192, 32768 below --max-seq-len; with --tune, "
                   "the buckets tuned (default --max-seq-len).")
@click.option("--db", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --tune: the tuning database (default: the user cache directory's).")
@click.option("--dump-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Also write every rendered CUDA source here.")
@click.option("--ort-include", type=click.Path(path_type=Path, file_okay=False), default=None,
              envvar="STOFC_ORT_INCLUDE", help="ONNX Runtime C/C++ API headers to build against.")
@click.option("--no-check", "no_check", is_flag=True,
              help="Do not run the package against the model on ONNX Runtime's CPU EP before "
                   "writing it (the check takes seconds; a package that fails it is never "
                   "written).")
@click.option("--quiet", is_flag=True, help="No progress lines.")
def compile_command(model: Path, mask: str, gpu: str, dtype: str, max_seq_len: int | None,
                    batch: int, out_dir: Path | None, tune: bool, budget: float | None,
                    seq_lens: tuple[int, ...], db: Path | None, dump_dir: Path | None,
                    ort_include: Path | None, no_check: bool, quiet: bool) -> None:
    """Compile MODEL with the structured mask into an ONNX Runtime package directory."""
    if max_seq_len is not None and max_seq_len < 1:
        raise StofcError(f"--max-seq-len {max_seq_len} is not positive",
                         hint="give the longest sequence length, e.g. --max-seq-len 512")
    if batch < 1:
        raise StofcError(f"--batch {batch} is not positive", hint="give a batch size >= 1")
    if budget is not None and (budget <= 0 or not tune):
        raise StofcError(f"--budget {budget:g} needs --tune and a positive number of seconds",
                         hint="e.g. --tune --budget 60")
    if db is not None and not tune:
        raise StofcError("--db chooses what --tune does, and --tune was not given",
                         hint="add --tune, or drop it")
    bad = [n for n in seq_lens if not 1 <= n <= (max_seq_len or MAX_SEQ_LEN)]
    if bad:
        raise StofcError(f"--seq-len {bad[0]} is outside 1..{max_seq_len or MAX_SEQ_LEN} "
                         "(--max-seq-len)",
                         hint="tune lengths up to the length the package is compiled for")
    ins = Instruments(progress=not quiet, dump_dir=dump_dir)
    path = compile_model(model, mask, gpu=gpu, dtype=dtype, max_seq_len=max_seq_len,
                         out_dir=out_dir, tune=tune, batch=batch, instruments=ins,
                         ort_include=ort_include, check=not no_check,
                         seq_lens=tuple(seq_lens) if seq_lens else None,
                         tune_options={"budget": budget, "batch": batch,
                                       "seq_lens": tuple(seq_lens), "db": db,
                                       "reporter": choose_reporter(quiet, False)})
    total = sum(t for _, t in ins.timings)
    click.echo(f"wrote {path} ({total:.1f} s)")
