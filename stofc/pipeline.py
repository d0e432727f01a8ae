"""The road from an ONNX model and a mask spec to a deployable package, in one function.

:func:`compile_model` reads top to bottom, each stage taking the previous one's
typed result::

    get_profile -> parse_mask -> load_model -> model_masks -> encode_masks (LayerMasks)
    -> build_plan (Plan) [-> tune (TunedPlan)] -> lower_plan (Program)
    -> render_kernels (RenderedKernel...) -> compile_kernels (CompiledKernel...)
    -> write_package (the package directory)

Each stage is called through :class:`Instruments` (hidet-style pass
instruments): timing, a progress line (rich, to stderr) and optional dumps of
the rendered sources are done there, never inline. Nothing here touches a GPU
unless ``tune=True``: then the model is loaded once, the plan tuned on the GPU
present between planning and lowering, and the package written once.

Two more entries join the same road from a written package (read once, through
:class:`~stofc.package.load.PackageDocument`): :func:`tune_package` (``stofc tune``:
the package's plan, tuned, rewritten in place) and :func:`recompile_package` (a
given plan, e.g. a tuner's, rewritten in place); both go through
:func:`build_package`, the road's second half.

The mask compiled for each layer is the model's own mask (read from the graph by
:func:`stofc.frontend.model_mask.model_masks`: causal, sliding windows, local/global
layers, constant buffers) AND the user's ``--mask`` spec (``model``, the default,
means the model's own mask alone; :mod:`stofc.masks.effective`): the package computes
exactly what the model computes, restricted by the structured mask, the function that
``stofc verify``'s reference computes too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

from stofc.codegen import Source
from stofc.compile.batch import compile_kernels
from stofc.errors import PackageError, PlanError, StofcError
from stofc.frontend import ModelGraph, load_model
from stofc.frontend.model_mask import model_masks
from stofc.kernels.render import render_kernels
from stofc.lower.attention import bucket_lengths
from stofc.lower.program import lower_plan
from stofc.masks import MaskSpec, parse_mask
from stofc.masks.effective import MODEL, effective_canonical, effective_specs
from stofc.masks.layers import LayerMasks, encode_layers, plan_id
from stofc.masks.limits import check_seq_len
from stofc.masks.spec import spec_files
from stofc.package.destination import check_destination
from stofc.package.load import read_plan_document
from stofc.package.manifest import check_manifest
from stofc.package.positions import check_positions, max_positions
from stofc.package.selfcheck import check_package_runs
from stofc.package.verify import original_model
from stofc.package.writer import PackageContents, write_package
from stofc.plan.build import build_plan
from stofc.plan.plan import Plan, TunedPlan
from stofc.targets import GpuProfile, get_profile
from stofc.tune import device
from stofc.tune.db import TuningDatabase
from stofc.tune.plan_tuner import tune_stage
from stofc.tune.progress import QuietReporter, Reporter

T = TypeVar("T")
DTYPE_NAMES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DEFAULT_GPU = "h100"
DEFAULT_MAX_SEQ_LEN = 512
DEFAULT_TILE = 64


@dataclass
class Instruments:
    """Wraps every stage: times it, shows progress, dumps sources (``dump_dir``)."""

    progress: bool = True
    dump_dir: Path | None = None
    timings: list[tuple[str, float]] = field(default_factory=list)
    nested: dict[str, float] = field(default_factory=dict)  # stages run inside another stage
    _console: Any = None
    _depth: int = 0

    def _print(self, text: str) -> None:
        if not self.progress:
            return
        if self._console is None:
            self._console = Console(stderr=True, highlight=False)
        self._console.print(text)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` and report it when done."""
        start = time.perf_counter()
        indent = "  " * self._depth
        self._depth += 1
        try:
            yield
        except BaseException:
            self._print(f"[red]✗[/red] {indent}{name:<28} "
                        f"{(time.perf_counter() - start) * 1000:9.1f} ms")
            raise
        finally:
            self._depth -= 1
        elapsed = time.perf_counter() - start
        if not self._depth:  # a stage inside another is counted in the outer one
            self.timings.append((name, elapsed))
        else:
            self.nested[name] = self.nested.get(name, 0.0) + elapsed
        self._print(f"[green]✓[/green] {indent}{name:<28} {elapsed * 1000:9.1f} ms")

    def note(self, text: str) -> None:
        """An informational line (with the progress lines)."""
        self._print(f"[blue]i[/blue] {text}")

    def warn(self, text: str) -> None:
        """A warning line (shown even when progress is off)."""
        click.echo(f"warning: {text}", err=True)

    def run(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` as stage ``name``."""
        with self.stage(name):
            return fn(*args, **kwargs)

    def dump(self, sources: list[Source]) -> None:
        """Write each rendered source to ``dump_dir`` when set."""
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        for src in sources:
            (self.dump_dir / f"{src.name}.cu").write_text(src.code)


def normalize_dtype(dtype: str) -> str:
    """``fp16``/``bf16`` (or the long names) -> ``float16``/``bfloat16``."""
    try:
        return DTYPE_NAMES[dtype.strip().lower()]
    except KeyError:
        raise PlanError(f"dtype {dtype!r} is not supported", hint="use fp16 or bf16") from None


def encode_masks(graph: ModelGraph, spec: MaskSpec | dict[int, MaskSpec], max_seq_len: int,
                 tile: int, *, canonical: str | None = None) -> LayerMasks:
    """One format per layer of ``graph`` (equal layers share the object); ``spec`` is one
    spec for every layer or one per layer (:func:`stofc.masks.effective.effective_specs`),
    ``canonical`` their canonical JSON (the plan records its hash)."""
    if canonical is None:
        canonical = (effective_canonical(spec) if isinstance(spec, dict) else spec.canonical())
    return encode_layers(spec, {layer.index: layer.attention.num_heads for layer in graph.layers},
                         max_seq_len, tile, plan_id=plan_id(canonical))


@dataclass(frozen=True)
class MaskRecord:
    """What the package records of the mask: the spec as given, the effective spec's
    canonical JSON, and whether the model's causal mask was ANDed in."""

    text: str
    canonical: str
    causal_from_model: bool


def compile_model(model_path: str | Path, mask: str = MODEL, *, gpu: str = DEFAULT_GPU,
                  dtype: str = "fp16", max_seq_len: int | None = None,
                  out_dir: str | Path | None = None, tune: bool = False, batch: int = 1,
                  tile: int = DEFAULT_TILE, instruments: Instruments | None = None,
                  ort_include: str | Path | None = None,
                  tune_options: dict[str, Any] | None = None, pack_qkv: bool = True,
                  check: bool = True, seq_lens: tuple[int, ...] | None = None) -> Path:
    """Compile ``model_path`` with the structured ``mask`` into a package; return its path.

    ``mask`` is ANDed with the mask every layer of the model computes itself
    (``"model"``: that mask alone); see the module doc.

    ``check``: before the package is put in place it must run on ONNX Runtime's CPU EP
    and match the model with the structured mask (:mod:`stofc.package.selfcheck`);
    ``--no-check`` turns this off.

    ``pack_qkv=False`` keeps three Q, K, V GEMMs per layer; with ``pack_qkv`` the model
    is loaded with its Q, K, V projections packed in the graph
    (:mod:`stofc.frontend.pack`), so the plan has one ``qkv`` GEMM segment per layer,
    and plan.json's ``model.pack_projections`` says so (recompile and tune pack too).
    ``tune``: tune the plan on the GPU present first (``tune_options``: ``budget``,
    ``batch``, ``seq_lens``, ``db``, ``reporter``, ``seed``); when tuning fails the
    untuned package is written and the failure raised. ``seq_lens``: the sequence-length
    buckets below ``max_seq_len`` at which the kernel selector also picks each layer's
    attention kernel (the mask encoded at that length), the package switching to that
    pick at run time for ``S <= bucket`` (:mod:`stofc.lower.attention`); default
    :data:`stofc.lower.attention.DEFAULT_BUCKETS`, ``()`` for none; a tuned plan's buckets replace them.
    ``max_seq_len`` defaults to 512,
    or to the model's position table when that is shorter
    (:mod:`stofc.package.positions`); a longer one is refused. ``out_dir`` defaults to
    ``<model stem>.stofc/`` beside the model. Raises a
    :class:`~stofc.errors.StofcError` (one line) for any user error; nothing is
    left half-written.
    """
    ins = instruments or Instruments()
    model_path = Path(model_path)
    out = Path(out_dir) if out_dir is not None else model_path.with_name(f"{model_path.stem}.stofc")
    dtype = normalize_dtype(dtype)
    if (max_seq_len is not None and max_seq_len < 1) or batch < 1:
        raise PlanError(f"max_seq_len={max_seq_len}, batch={batch} must be positive",
                        hint="pass --max-seq-len and --batch as positive integers")
    if max_seq_len is not None:
        check_seq_len(max_seq_len, what="--max-seq-len", tile=tile)
    options = tune_options or {}
    protect = (model_path, *_mask_files(mask), ins.dump_dir, options.get("db"))
    check_destination(out, protect=protect)  # before any work: nothing foreign is touched
    profile = ins.run("target", get_profile, gpu)
    spec = None if mask.strip() == MODEL else ins.run("parse mask", parse_mask, mask)
    if spec is not None:
        check_destination(out, protect=spec_files(spec))
    if tune:  # tuning measures on the GPU present: check it before compiling anything
        profile = ins.run("check GPU", device.check_gpu, gpu)
    # pack Q, K, V projections in the graph (stofc.frontend.pack) unless asked to keep three
    graph = ins.run("load model", load_model, model_path, pack_projections=pack_qkv)
    if not graph.layers:
        raise PlanError(f"{model_path}: no attention block stofc can fuse",
                        hint="run `stofc inspect` to see why each block was left to ORT")
    if spec is not None:
        spec.check_layers(len(graph.layers))
    max_seq_len = _max_seq_len(graph, max_seq_len, ins)
    check_seq_len(max_seq_len, what="--max-seq-len", tile=tile)
    too_long = [n for n in options.get("seq_lens", ()) if n > max_seq_len]
    if tune and too_long:
        raise PlanError(f"--seq-len {too_long[0]} is longer than the package's max_seq_len "
                        f"{max_seq_len}", hint="tune lengths up to the length it is compiled for")
    blocks = [u for u in graph.unsupported if u.op_type in ("Softmax", "Attention")]
    if blocks:
        left = sorted({u.reason for u in blocks})
        ins.warn(f"{len(blocks)} attention-like block(s) are left to ONNX Runtime "
                 f"unchanged, without the structured mask ({'; '.join(left)[:300]})")
    own = ins.run("read the model's masks", model_masks, graph, max_seq_len)
    effective = effective_specs({m.layer: m.node for m in own.layers}, spec,
                                [layer.index for layer in graph.layers])
    canonical = effective_canonical(effective)
    masks = ins.run("encode masks", encode_masks, graph, effective, max_seq_len, tile,
                    canonical=canonical)
    lengths = bucket_lengths(seq_lens, max_seq_len)
    length_masks = {n: encode_masks(graph, effective, n, tile, canonical=canonical)
                    for n in lengths}
    if lengths:
        ins.note(f"attention kernels are also chosen for the sequence-length buckets "
                 f"{', '.join(map(str, lengths))} (--seq-len)")
    plan = ins.run("plan", build_plan, graph, masks, profile, dtype=dtype,
                   max_seq_len=max_seq_len, batch=batch)
    tuned, failure = TunedPlan.untuned(plan), None
    if tune:
        try:
            tuned = ins.run("tune", _tune, plan, graph, masks, profile, options)
        except StofcError as err:
            failure = err
    record = MaskRecord(mask, canonical, own.structured)
    path = build_package(out, graph, tuned, masks, profile, record, source_model=model_path,
                         pack_qkv=pack_qkv, instruments=ins, ort_include=ort_include,
                         check=check, protect=protect, length_masks=length_masks)
    if failure is not None:
        raise StofcError(f"the untuned package was written to {path}, but --tune failed: "
                         f"{failure.message}", hint=failure.hint) from None
    return path


def build_package(out: Path, graph: ModelGraph, tuned: TunedPlan, masks: LayerMasks,
                  profile: GpuProfile, mask: MaskRecord, *, source_model: Path, pack_qkv: bool,
                  instruments: Instruments | None = None,
                  ort_include: str | Path | None = None, check: bool = True,
                  protect: tuple[Path | None, ...] = (),
                  length_masks: dict[int, LayerMasks] | None = None) -> Path:
    """The road's second half: lower the (tuned) plan, render and compile every kernel,
    write the package to ``out`` atomically (``check``: once it ran on the CPU EP and
    matched the model, :mod:`stofc.package.selfcheck`); its path. ``length_masks``: the
    masks encoded at each selector bucket length (untuned plans)."""
    ins = instruments or Instruments()
    program = ins.run("lower", lower_plan, graph, tuned, masks, profile, pack_qkv=pack_qkv,
                      length_masks=length_masks)
    rendered = ins.run("render kernels", render_kernels, (*program.kernels, *program.twins),
                       program.targets)
    ins.dump([r.source for r in rendered])
    compiled = ins.run(f"compile ({len(rendered)} kernels x {len(program.targets)})",
                       compile_kernels, rendered, program.targets)
    contents = PackageContents(graph=graph, program=program, rendered=rendered,
                               compiled=compiled, mask_text=mask.text,
                               mask_canonical=mask.canonical,
                               mask_causal_from_model=mask.causal_from_model,
                               source_model=source_model, pack_projections=pack_qkv)
    return ins.run("write package", write_package, out, contents, ort_include=ort_include,
                   verify=_checker(ins, contents) if check else None, protect=protect)


def _max_seq_len(graph: ModelGraph, asked: int | None, ins: Instruments) -> int:
    """``asked`` (refused beyond the model's position table), else the default 512 or the
    table's length when shorter."""
    if asked is not None:
        check_positions(graph, asked)
        return asked
    table = max_positions(graph)
    if table is not None and table.rows < DEFAULT_MAX_SEQ_LEN:
        ins.note(f"max_seq_len {table.rows}: the model's position table '{table.name}' has "
                 f"{table.rows} positions (pass --max-seq-len to choose a shorter one)")
        return table.rows
    return DEFAULT_MAX_SEQ_LEN


def _checker(ins: Instruments, contents: PackageContents) -> Callable[[Path], None]:
    """The write's ``verify``: the package runs and matches the model (a stage of its own)."""
    def verify(tmp: Path) -> None:
        ins.run("check package (CPU EP)", check_package_runs, tmp, contents)
    return verify


def _mask_files(mask: str) -> tuple[Path, ...]:
    """The mask spec's own file, when it is one (read before the spec is parsed)."""
    path = Path(mask.strip()).expanduser()
    return (path,) if path.suffix.lower() in (".yaml", ".yml") and path.is_file() else ()


def _tune(plan: Plan, graph: ModelGraph, masks: LayerMasks, profile: GpuProfile,
          options: dict[str, Any]) -> TunedPlan:
    """The tune stage of ``compile --tune`` (the GPU was checked before anything else)."""
    reporter = options.get("reporter") or QuietReporter()
    with TuningDatabase.open(options.get("db"), on_warning=reporter.warning) as db:
        return tune_stage(plan, graph, masks, profile, db, reporter,
                          budget_s=options.get("budget"), batch=int(options.get("batch", 1)),
                          seq_lens=tuple(options.get("seq_lens", ())),
                          seed=int(options.get("seed", 0)))


def recompile_package(package_dir: str | Path, plan: Plan, *, model: str | Path | None = None,
                      instruments: Instruments | None = None,
                      ort_include: str | Path | None = None, tuned: bool = True,
                      buckets: tuple[tuple[int, Plan], ...] = (), check: bool = True) -> Path:
    """Rewrite the package in ``package_dir`` for a new ``plan`` (a tuner's, or hand-made).

    ``check``: the rewritten package must pass ``stofc compile``'s check before it
    replaces the old one (:mod:`stofc.package.selfcheck`).

    The original model comes from ``model`` or the path recorded in plan.json
    (hash-checked); the mask formats are the package's own. ``tuned``: the plan's
    attention configs replace the selector's (module doc of
    :mod:`stofc.lower.attention`); ``buckets``: ``(length, plan)`` of every tuned
    sequence-length bucket (shorter buckets' attention configs become run-time
    variants, cuBLASLt ranks FusedGemm attributes). The write is atomic like
    :func:`compile_model`'s.
    """
    ins = instruments or Instruments()
    package_dir = Path(package_dir)
    doc = read_plan_document(package_dir)
    source = original_model(package_dir, doc, model)
    # the plan was built from the graph as the package was (packed or not): load it so
    graph = ins.run("load model", load_model, source, pack_projections=doc.pack_projections)
    record = MaskRecord(doc.mask_spec, doc.mask_effective, doc.mask_causal_from_model)
    return build_package(package_dir, graph, TunedPlan(plan, buckets, tuned), doc.masks(),
                         get_profile(plan.gpu), record, source_model=source,
                         pack_qkv=doc.pack_projections, instruments=ins,
                         ort_include=ort_include, check=check)


def tune_package(package_dir: str | Path, profile: GpuProfile, db: TuningDatabase,
                 reporter: Reporter, *, budget_s: float | None, batch: int,
                 seq_lens: tuple[int, ...], seed: int = 0,
                 instruments: Instruments | None = None,
                 ort_include: str | Path | None = None, check: bool = True) -> Path:
    """``stofc tune``: tune the package in ``package_dir`` on the GPU present and rewrite it.

    Everything ``stofc tune`` checks (GPU name, GPU present, package directory,
    database) happens before. The package's plan.json is read once
    (:class:`~stofc.package.load.PackageDocument`: the plan, the mask formats, the
    original model, hash-checked), the model loaded once, every sequence-length
    bucket tuned (:func:`stofc.tune.plan_tuner.tune_stage`: real kernels in an
    isolated worker, winners verified against float64 references, everything stored
    in ``db``, so a later run starts warm), and the package rewritten in place once,
    atomically. The package's plan is the largest bucket's (those kernels take the
    length at run time); each shorter bucket whose tuned attention config differs
    becomes a run-time variant of its layer's SparseAttention node (OPS.md). ``check``:
    the rewritten package must pass ``stofc compile``'s check before it replaces the old
    one.
    """
    ins = instruments or Instruments(progress=False)
    package_dir = Path(package_dir)
    check_manifest(package_dir)  # first: an edited plan.json is "modified", not a parse error
    doc = read_plan_document(package_dir)
    plan = doc.plan
    if plan.arch != profile.arch:
        raise PackageError(f"the package was compiled for {plan.gpu} ({plan.arch}) and the GPU "
                           f"present is an {profile.name} ({profile.arch})",
                           hint=f"compile it again with --gpu {profile.name}, then tune")
    source = original_model(package_dir, doc, None)
    graph = ins.run("load model", load_model, source, pack_projections=doc.pack_projections)
    masks = doc.masks()
    tuned = ins.run("tune", tune_stage, plan, graph, masks, profile, db, reporter,
                    budget_s=budget_s, batch=batch, seq_lens=seq_lens, seed=seed)
    record = MaskRecord(doc.mask_spec, doc.mask_effective, doc.mask_causal_from_model)
    return build_package(package_dir, graph, tuned, masks, profile, record,
                         source_model=source, pack_qkv=doc.pack_projections, instruments=ins,
                         ort_include=ort_include, check=check)
