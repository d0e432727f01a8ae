"""The road from an ONNX model and a mask spec to a deployable package, in one function.

:func:`compile_model` reads top to bottom::

    get_profile -> parse_mask -> load_model -> build_plan -> encode masks
    -> select + render kernels -> compile_source (cubin + PTX) -> write_package [-> tune]

Each stage is called through :class:`Instruments` (hidet-style pass
instruments): timing, a progress line (rich, to stderr) and optional dumps of
the rendered sources are done there, never inline. Nothing here touches a GPU
unless ``tune=True``, which hands the written package to the tuner's
integration point (:func:`stofc.tune.package.tune_package`).

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
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from stofc.codegen import Source
from stofc.errors import PlanError, StofcError
from stofc.frontend import ModelGraph, load_model
from stofc.frontend.model_mask import model_masks
from stofc.frontend.pack import packed_from_document
from stofc.masks import MaskSpec, encode, parse_mask
from stofc.masks.effective import MODEL, effective_canonical, effective_specs
from stofc.masks.format import MaskFormat
from stofc.masks.limits import check_seq_len
from stofc.masks.spec import spec_files
from stofc.package.destination import check_destination
from stofc.package.kernels import (
    AttentionKernel,
    AttentionVariant,
    attention_kernel,
    compile_all,
    render_segment,
)
from stofc.package.positions import check_positions, max_positions
from stofc.package.rewrite import attention_inputs
from stofc.package.selfcheck import check_package_runs
from stofc.package.writer import PackageContents, write_package
from stofc.plan.build import build_plan
from stofc.plan.plan import KernelSpec, Plan
from stofc.targets import GpuProfile, get_profile

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
            from rich.console import Console
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
        import click
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

    def dump_package(self, package: Path) -> None:
        """Also dump the sources the package writer rendered itself (the CUDA twins'
        epilogue kernels, chosen from the rewritten model's nodes)."""
        if self.dump_dir is None:
            return
        for cu in sorted((package / "kernels").glob("*.cu")):
            if not (self.dump_dir / cu.name).exists():
                (self.dump_dir / cu.name).write_text(cu.read_text())


def normalize_dtype(dtype: str) -> str:
    """``fp16``/``bf16`` (or the long names) -> ``float16``/``bfloat16``."""
    try:
        return DTYPE_NAMES[dtype.strip().lower()]
    except KeyError:
        raise PlanError(f"dtype {dtype!r} is not supported", hint="use fp16 or bf16") from None


def with_causal(spec: MaskSpec) -> MaskSpec:
    """``spec`` with ``causal=true`` on the default and every override."""
    def causal(o):
        return replace(o, node=replace(o.node, causal=True))
    return replace(spec, default=replace(spec.default, causal=True),
                   layers=tuple(causal(o) for o in spec.layers),
                   heads=tuple(causal(o) for o in spec.heads))


def encode_masks(graph: ModelGraph, spec: MaskSpec | dict[int, MaskSpec], max_seq_len: int,
                 tile: int) -> dict[int, MaskFormat]:
    """One format per layer (equal layers share the object); ``spec`` is one spec for
    every layer or one per layer (:func:`stofc.masks.effective.effective_specs`)."""
    formats: dict[int, MaskFormat] = {}
    seen: dict[str, MaskFormat] = {}
    for layer in graph.layers:
        layer_spec = spec[layer.index] if isinstance(spec, dict) else spec
        fmt = encode(layer_spec, max_seq_len, tile=tile, layer=layer.index,
                     num_heads=layer.attention.num_heads)
        formats[layer.index] = seen.setdefault(fmt.spec_hash, fmt)
    return formats


def select_attention(graph: ModelGraph, formats: dict[int, MaskFormat], profile: GpuProfile, *,
                     dtype: str, batch: int, max_seq_len: int) -> dict[int, AttentionKernel]:
    """The attention kernel of every layer, for the inputs its SparseAttention node gets."""
    out = {}
    for layer in graph.layers:
        block = layer.attention
        kpm, bias = attention_inputs(block, graph)
        out[layer.index] = attention_kernel(
            layer.index, formats[layer.index], profile, num_heads=block.num_heads,
            head_dim=block.head_dim, dtype=dtype, batch=batch, seq_len=max_seq_len,
            has_bias=bias is not None, has_key_bits=kpm is not None,
            has_softcap=block.softcap > 0)
    return out


def record_attention(plan: Plan, kernels: dict[int, AttentionKernel]) -> Plan:
    """The plan with each attention segment's kernel spec set to the selector's choice."""
    layers = []
    for lp in plan.layers:
        segs = []
        for seg in lp.segments:
            if seg.family == "attention" and lp.index in kernels:
                ak = kernels[lp.index]
                c = ak.choice.config
                spec = KernelSpec("attention", f"attention/{c.kind}.cu.j2", (
                    ("dtype", plan.dtype), *asdict(c).items(),
                    ("has_bias", ak.spec.has_bias), ("has_key_bits", ak.spec.has_key_bits),
                    ("has_softcap", ak.spec.has_softcap)))
                seg = replace(seg, kernel=spec)
            segs.append(seg)
        layers.append(replace(lp, segments=tuple(segs)))
    return replace(plan, layers=tuple(layers))


def compile_model(model_path: str | Path, mask: str = MODEL, *, gpu: str = DEFAULT_GPU,
                  dtype: str = "fp16", max_seq_len: int | None = None,
                  out_dir: str | Path | None = None, tune: bool = False, batch: int = 1,
                  tile: int = DEFAULT_TILE, instruments: Instruments | None = None,
                  ort_include: str | Path | None = None,
                  tune_options: dict[str, Any] | None = None, pack_qkv: bool = True,
                  check: bool = True) -> Path:
    """Compile ``model_path`` with the structured ``mask`` into a package; return its path.

    ``mask`` is ANDed with the mask every layer of the model computes itself
    (``"model"``: that mask alone); see the module doc.

    ``check``: before the package is put in place it must run on ONNX Runtime's CPU EP
    and match the model with the structured mask (:mod:`stofc.package.selfcheck`);
    ``--no-check`` turns this off.

    ``pack_qkv=False`` keeps three Q, K, V GEMMs per layer (``rewrite_model``); with
    ``pack_qkv`` the model is loaded with its Q, K, V projections packed in the graph
    (:mod:`stofc.frontend.pack`), so the plan has one ``qkv`` GEMM segment per layer,
    and plan.json's ``model.pack_projections`` says so (recompile and tune pack too).
    ``max_seq_len`` defaults to 512, or to the model's position table when that is
    shorter (:mod:`stofc.package.positions`); a longer one is refused.
    ``out_dir`` defaults to ``<model stem>.stofc/`` beside the model. Raises a
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
        from stofc.tune.device import check_gpu
        profile = ins.run("check GPU", check_gpu, gpu)
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
    plan = ins.run("plan", build_plan, graph, canonical, profile, dtype=dtype,
                   max_seq_len=max_seq_len, batch=batch)
    formats = ins.run("encode masks", encode_masks, graph, effective, max_seq_len, tile)
    attention = ins.run("select attention kernels", select_attention, graph, formats, profile,
                        dtype=dtype, batch=batch, max_seq_len=max_seq_len)
    plan = record_attention(plan, attention)
    contents = _render_and_compile(
        ins, graph, plan, profile, formats, attention, source_model=model_path, mask_text=mask,
        mask_canonical=canonical, causal=own.structured, tuned=False)
    contents = replace(contents, pack_qkv=pack_qkv, pack_projections=pack_qkv)
    path = ins.run("write package", write_package, out, contents, ort_include=ort_include,
                   verify=_checker(ins, contents) if check else None, protect=protect)
    ins.dump_package(path)
    if tune:
        ins.run("tune", _tune, path, profile, {**options, "check": check})
    return path


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


def _render_and_compile(ins: Instruments, graph: ModelGraph, plan: Plan, profile: GpuProfile,
                        formats: dict[int, MaskFormat], attention: dict[int, AttentionKernel], *,
                        source_model: Path, mask_text: str, mask_canonical: str, causal: bool,
                        tuned: bool, buckets: tuple[tuple[int, Plan], ...] = ()
                        ) -> PackageContents:
    """Render every kernel of ``plan``, compile each for the profile's targets; the contents."""
    segment_sources = ins.run("render kernels", _render_segments, plan)
    sources = [s for srcs in segment_sources.values() for s in srcs]
    sources += [src for a in attention.values() for src in a.sources]
    ins.dump(sources)
    targets = (profile.arch, profile.ptx_target)
    compiled = ins.run(f"compile ({len({s.name for s in sources})} kernels x {len(targets)})",
                       compile_all, sources, targets)
    return PackageContents(
        graph=graph, plan=plan, profile=profile, mask_text=mask_text,
        mask_canonical=mask_canonical, mask_causal_from_model=causal, formats=formats,
        segment_sources=segment_sources, attention=attention, compiled=compiled,
        targets=targets, source_model=source_model, tuned=tuned, buckets=buckets)


def recompile_package(package_dir: str | Path, plan: Plan, *, model: str | Path | None = None,
                      instruments: Instruments | None = None,
                      ort_include: str | Path | None = None, tuned: bool = True,
                      buckets: tuple[tuple[int, Plan], ...] = (), check: bool = True) -> Path:
    """Rewrite the package in ``package_dir`` for a new ``plan`` (the tuner's schemes/configs).

    ``check``: the rewritten package must pass ``stofc compile``'s check before it
    replaces the old one (:mod:`stofc.package.selfcheck`).

    The original model comes from ``model`` or the path recorded in plan.json
    (hash-checked); the mask formats are the package's own. Attention segments
    whose kernel spec names a template (``attention/block.cu.j2``, params
    holding the ``AttentionConfig`` fields) keep that config; others get the
    selector's choice. ``buckets``: ``(length, plan)`` of every tuned
    sequence-length bucket; each shorter bucket's attention config becomes a
    run-time variant of its layer's node (used when ``S <= length``), ``plan``'s
    serves the rest. The write is atomic like :func:`compile_model`'s.
    """
    from stofc.masks import load as load_format
    from stofc.package.load import read_plan_document
    from stofc.package.verify import original_model

    ins = instruments or Instruments()
    package_dir = Path(package_dir)
    doc = read_plan_document(package_dir)
    source = original_model(package_dir, doc, model)
    packed = packed_from_document(doc)  # the plan was built from the packed graph: pack again
    graph = ins.run("load model", load_model, source, pack_projections=packed)
    profile = get_profile(plan.gpu)
    formats: dict[int, MaskFormat] = {}
    for entry in doc["mask"]["formats"]:
        fmt = load_format(package_dir / entry["npz"])
        formats.update({int(layer): fmt for layer in entry["layers"]})
    attention = select_attention(graph, formats, profile, dtype=plan.dtype,
                                 batch=max(1, plan.tokens // max(1, plan.max_seq_len)),
                                 max_seq_len=plan.max_seq_len)
    attention = {k: _planned_attention(plan, ak, buckets) for k, ak in attention.items()}
    plan = record_attention(plan, attention)
    mask = doc["mask"]
    contents = _render_and_compile(
        ins, graph, plan, profile, formats, attention, source_model=source,
        mask_text=mask["spec"], mask_canonical=_canonical(mask["effective"]),
        causal=bool(mask["causal_from_model"]), tuned=tuned, buckets=buckets)
    contents = replace(contents, pack_projections=packed)
    path = ins.run("write package", write_package, package_dir, contents,
                   ort_include=ort_include, verify=_checker(ins, contents) if check else None)
    ins.dump_package(path)
    return path


def _canonical(obj: Any) -> str:
    from stofc.masks.spec import canonical_json
    return canonical_json(obj)


def _plan_config(plan: Plan, layer: int):
    """The AttentionConfig the plan's attention segment of ``layer`` names, or None."""
    from stofc.kernels.attention import AttentionConfig

    seg = next(s for lp in plan.layers if lp.index == layer for s in lp.segments
               if s.family == "attention")
    spec = seg.kernel
    if not spec.template.startswith("attention/") or spec.param("kind") is None:
        return None
    names = {f.name for f in fields(AttentionConfig)}
    return AttentionConfig(**{k: v for k, v in spec.params if k in names})


def _planned_attention(plan: Plan, ak: AttentionKernel,
                       buckets: tuple[tuple[int, Plan], ...] = ()) -> AttentionKernel:
    """``ak`` with the config the plan's attention segment names (if it names one).

    A plan's config replaces the selector's choice and its run-time variants (the
    tuner measured it); each bucket of ``buckets`` shorter than the plan's own
    length adds a variant for ``S <= length`` unless the next one would pick the
    same kernel anyway.
    """
    from stofc.kernels.attention import KernelSpec as AttnSpec
    from stofc.kernels.attention import render_kernel

    cfg = _plan_config(plan, ak.layer)
    if cfg is None:
        return ak

    def spec_of(c):
        return AttnSpec(c, ak.spec.dtype, ak.spec.head_dim, has_bias=ak.spec.has_bias,
                        has_key_bits=ak.spec.has_key_bits, has_softcap=ak.spec.has_softcap)

    chain: list[tuple[int, Any]] = []
    for length, bplan in sorted(buckets, key=lambda b: b[0]):
        bcfg = _plan_config(bplan, ak.layer)
        if bcfg is not None and length < plan.max_seq_len:
            chain.append((length, bcfg))
    kept: list[tuple[int, Any]] = []
    following = cfg
    for length, bcfg in reversed(chain):
        if bcfg != following:
            kept.insert(0, (length, bcfg))
            following = bcfg
    variants = tuple(
        AttentionVariant(length, 0, replace(ak.choice, kernel=c.kind, config=c), spec_of(c),
                         render_kernel(spec_of(c)), f"tuned for S <= {length}")
        for length, c in kept)
    if cfg == ak.choice.config and not variants:
        return replace(ak, variants=())
    choice = replace(ak.choice, kernel=cfg.kind, config=cfg,
                     explanation=f"from the plan: {cfg.describe()} (the selector's analytical "
                                 f"choice was {ak.choice.config.describe()})")
    return AttentionKernel(ak.layer, choice, spec_of(cfg), render_kernel(spec_of(cfg)), variants)


def _render_segments(plan: Plan) -> dict[tuple[int, int], tuple[Source, ...]]:
    return {(seg.layer, seg.ordinal): render_segment(seg, plan.dtype)
            for lp in plan.layers for seg in lp.segments
            if seg.family not in ("attention", "ort")}


def _tune(path: Path, profile: GpuProfile, options: dict[str, Any]) -> None:
    """Hand the written package to the tuner (the GPU was checked before compiling)."""
    from stofc.tune.db import TuningDatabase
    from stofc.tune.package import tune_package
    from stofc.tune.progress import QuietReporter

    reporter = options.get("reporter") or QuietReporter()
    with TuningDatabase.open(options.get("db"), on_warning=reporter.warning) as db:
        try:
            tune_package(path, profile, db, reporter, budget_s=options.get("budget"),
                         batch=int(options.get("batch", 1)),
                         seq_lens=tuple(options.get("seq_lens", ())),
                         check=bool(options.get("check", True)))
        except StofcError as err:
            raise StofcError(f"the untuned package was written to {path}, but --tune failed: "
                             f"{err.message}", hint=err.hint) from None
