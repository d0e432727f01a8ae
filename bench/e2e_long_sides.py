"""The timed sides of ``bench/e2e_long.py`` (GPU): ORT sessions, short-point rounds with and
without CUDA graphs, the torch side, the fp32 check at long lengths, the profile split.

``run`` is ``e2e_long.Run`` (model case, work dir, graph, packages, kept outputs, args);
``rec`` the ``e2e_models.Recorder``. Every function records its rows and its failures
(one line each) and never raises for one side failing.
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np
from e2e_models import one_line, rel_error

OUTPUT = "last_hidden_state"
CHECK_BOUND = 1e-2  # TARGETS.md: end to end <= 1e-2 (verify_package's bound)
DEVICE = {"type": "cuda"}  # "cpu": the --rehearse run (ORT CPU EP, torch on the CPU)


def cuda() -> bool:
    return DEVICE["type"] == "cuda"


def gpu_used_mib() -> float | None:
    from stofc.package.bench import device_memory_used

    used = device_memory_used() if cuda() else None
    return None if used is None else used / 2**20


def _diff(before: float | None, after: float | None) -> float | None:
    """MiB a session added (None when the device memory cannot be read)."""
    return None if before is None or after is None else round(after - before, 1)


def _free_cached() -> None:
    import torch

    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def _providers(graph: bool) -> list:
    from stofc.package.bench import graph_providers, memory_providers

    if not cuda():
        return ["CPUExecutionProvider"]
    return graph_providers() if graph else memory_providers()


def _binding(session, feeds: dict):
    """IOBinding with device-resident inputs and outputs (host ones in a rehearsal)."""
    from stofc.package.bench import device_binding

    if cuda():
        return device_binding(session, feeds)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for out in session.get_outputs():
        binding.bind_output(out.name)
    return binding


def ort_opener(run, graph: bool = False):
    """Opens ORT's optimized model (arena grows by what is asked; or with CUDA graphs)."""
    import onnxruntime as ort

    return lambda: ort.InferenceSession(str(run.base), providers=_providers(graph))


def stofc_opener(run, mask: str, graph: bool = False):
    from stofc.package.load import load

    return lambda: load(run.packages[mask], providers=_providers(graph))


def ort_point(run, rec, impl: str, mask: str | None, b: int, s: int, open_session) -> None:
    """One ORT session (stofc's or ORT's) at (b, s): fresh, timed, its peak memory."""
    from e2e_torch import plan_runs

    from stofc.package.bench import timed_runs

    where = dict(model=run.name, mask=mask, impl=impl, graph=False, B=b, S=s)
    if not rec.fits("stofc" if impl == "stofc" else "ort", **where):
        return
    feeds, real = run.inputs(b, s)
    session = None
    try:
        _free_cached()
        before, start = gpu_used_mib(), time.time()
        session = open_session()
        session_s = time.time() - start
        binding = _binding(session, feeds)
        start = time.time()
        session.run_with_iobinding(binding)
        warm, reps = plan_runs(time.time() - start, run.args.warmup, run.args.repeat, 3.0)
        med, p10, p90 = timed_runs(session, binding, warmup=warm, repeat=reps)
        after = gpu_used_mib()
        out = binding.copy_outputs_to_cpu()[0]
        if run.keep(b, s):
            run.outs[(impl, mask, b, s)] = out
        rec.emit(kind="time", **where, ms=med, p10=p10, p90=p90, runs=reps,
                 mem_mib=_diff(before, after),
                 session_s=round(session_s, 1), finite=bool(np.isfinite(out[real]).all()))
    except Exception as err:  # OOM / refusal: ORT's own exception types, one line
        rec.emit(kind="error", **where, err=one_line(err))
    finally:
        session = None
        gc.collect()


def plain_output(run, impl: str, mask: str | None, b: int, s: int):
    """The plain session's output at (b, s): kept from its timing row, else one run of a
    fresh session (a call that runs only the graph or check stages)."""
    if (impl, mask, b, s) not in run.outs:
        feeds, _ = run.inputs(b, s)
        opener = ort_opener(run) if mask is None else stofc_opener(run, mask)
        session = opener()
        try:
            binding = _binding(session, feeds)
            session.run_with_iobinding(binding)
            run.outs[(impl, mask, b, s)] = binding.copy_outputs_to_cpu()[0]
        finally:
            session = None
            gc.collect()
    return run.outs[(impl, mask, b, s)]


def short_point(run, rec, b: int, s: int, graph: bool, rounds: int) -> None:
    """ORT and every package at a short point, in fresh sessions held open together and
    timed in ``rounds`` rounds (each round times every side once: ``warmup`` + ``repeat``).

    Row: ms = median of the round medians, ``rounds`` = those medians, ``mem_mib`` (plain).
    With ``graph``: ``enable_cuda_graph`` sessions bound at fixed buffers; after the rounds
    each replays once more onto poisoned outputs, checked against the plain session's
    output (a different result is an error row, never a timing); a capture ORT refuses is
    a ``refused`` row with its reason.
    """
    from stofc.package.bench import GRAPH_TOLERANCE, graph_binding, replay_outputs, timed_runs

    if graph and not cuda():
        rec.emit(kind="skip", step="graph", model=run.name, B=b, S=s,
                 why="rehearsal on the CPU: no CUDA graphs")
        return
    feeds, real = run.inputs(b, s)
    sides = [("ort", None, ort_opener(run, graph))] if run.base is not None else []
    sides += [("stofc", m, stofc_opener(run, m, graph)) for m in run.packages]
    held = {}
    _free_cached()
    for impl, mask, opener in sides:
        where = dict(model=run.name, mask=mask, impl=impl, graph=graph, B=b, S=s)
        try:
            before = gpu_used_mib()
            session = opener()
            io = None
            if graph:
                shape = plain_output(run, impl, mask, b, s).shape
                io = graph_binding(session, feeds, {OUTPUT: shape})
            binding = io.binding if io is not None else _binding(session, feeds)
            session.run_with_iobinding(binding)  # a CUDA-graph session captures here
            held[(impl, mask)] = dict(session=session, binding=binding, io=io, where=where,
                                      mem=_diff(before, gpu_used_mib()), ms=[])
        except Exception as err:  # ORT refuses capture with its own exception types
            rec.emit(kind="refused" if graph else "error", **where, err=one_line(err))
    for _ in range(rounds):
        for key, h in list(held.items()):
            try:
                h["ms"].append(timed_runs(h["session"], h["binding"], warmup=run.args.warmup,
                                          repeat=run.args.repeat)[0])
            except Exception as err:
                rec.emit(kind="error", **h["where"], err=one_line(err))
                del held[key]
    for (impl, mask), h in held.items():
        row = dict(kind="time", **h["where"], ms=statistics.median(h["ms"]), rounds=h["ms"],
                   runs=run.args.repeat)
        if graph:
            out = replay_outputs(h["session"], h["io"])[OUTPUT]
            row["vs_plain_rel"] = rel_error(out, run.outs[(impl, mask, b, s)], real)
            if not row["vs_plain_rel"] <= GRAPH_TOLERANCE:
                rec.emit(kind="error", **h["where"], err=f"the CUDA-graph replay is "
                         f"{row['vs_plain_rel']:.3g} (relative) away from the plain run")
                continue
        else:
            row["mem_mib"] = h["mem"]
            run.outs[(impl, mask, b, s)] = h["binding"].copy_outputs_to_cpu()[0]
        rec.emit(**row)
    held.clear()
    gc.collect()


# ---------------------------------------------------------------------------- torch side

def _torch_side(run, dtype: str | None = None):
    from e2e_torch import TorchSide

    kw = dict(fingerprint=run.info.get("fingerprint"), small=run.small, device=DEVICE["type"])
    if dtype is not None:  # the fp32 reference: its own instance, not kept
        return TorchSide(run.name, dtype, **kw)
    if run.torch is None:  # a rehearsal on the CPU runs fp32 (CPU flex has no half path)
        run.torch = TorchSide(run.name, run.case.dtype if cuda() else "fp32", **kw)
    return run.torch


def _ids(run, b: int, s: int):
    import torch

    feeds, _ = run.inputs(b, s)
    return torch.from_numpy(feeds["input_ids"]).to(DEVICE["type"])


def _at_length(masks, s: int):
    """The package's per-layer masks (decoded at L_max) at length ``s``: their top-left
    corner, which is what the package attends with at that length (FlexAttention refuses
    a block mask built for a longer length)."""
    of_layer, dense, specs = masks
    return of_layer, [d[..., :s, :s] for d in dense], specs


def torch_point(run, rec, impl: str, b: int, s: int, mode: str | None) -> None:
    """torch.compile(model) with ``impl`` attention at (b, s), every mask of the model (one
    compile per shape: the masks are swapped in place). ``mode="reduce-overhead"``: CUDA
    graphs (inductor's ``cudagraph_skips`` recorded: non-zero means it ran without)."""
    import torch
    from e2e_torch import NotExpressible, load_fa4, time_cuda
    from torch._dynamo.utils import counters

    graph = mode is not None
    masks = list(run.packages)
    if graph and not cuda():
        rec.emit(kind="skip", step="torch", model=run.name, impl=impl, B=b, S=s,
                 why="rehearsal on the CPU: no CUDA graphs")
        return
    if impl == "fa4" and (why := load_fa4()):
        for mask in masks:
            rec.emit(kind="na", model=run.name, mask=mask, impl=impl, graph=graph, B=b, S=s,
                     why=why)
        return
    if not rec.fits("torch", model=run.name, impl=impl, graph=graph, B=b, S=s):
        return
    try:
        side = _torch_side(run)
        ids = _ids(run, b, s)
    except Exception as err:
        rec.emit(kind="error", step="torch", model=run.name, impl=impl, err=one_line(err))
        return
    _, real = run.inputs(b, s)
    for mask in masks:
        where = dict(model=run.name, mask=mask, impl=impl, graph=graph, B=b, S=s)
        try:
            valid = side.use(impl, *_at_length(run.layer_masks[mask], s))
        except NotExpressible as err:
            rec.emit(kind="na", **where, why=str(err))
            continue
        try:
            fresh = side.compile(b, s, mode, valid)
            skips = counters["inductor"]["cudagraph_skips"]
            _free_cached()
            if cuda():
                torch.cuda.reset_peak_memory_stats()
            start = time.time()
            for _ in range(3 if graph else 1):
                out = side.forward(ids)
            if cuda():
                torch.cuda.synchronize()
            first_s = time.time() - start
            got = out[:1].float().cpu().numpy()
            t = time_cuda(lambda: side.forward(ids), warmup=run.args.warmup,
                          repeat=run.args.repeat, cuda=cuda())
            row = dict(kind="time", **where, ms=t["ms"], p10=t["p10"], p90=t["p90"],
                       runs=t["runs"], mem_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1)
                       if cuda() else None,
                       compile_s=round(first_s, 1) if fresh else 0.0, recompiled=fresh,
                       finite=bool(np.isfinite(got).all()))
            if graph:
                row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
            pkg_out = run.outs.get(("stofc", mask, b, s))
            if pkg_out is not None:  # row 0 is never padded (make_inputs)
                row["vs_stofc_rel"] = rel_error(got, pkg_out[:1], real[:1])
            rec.emit(**row)
        except Exception as err:  # report and go on
            rec.emit(kind="error", **where, err=one_line(err))
            side.key = None  # a failed compile is not reused


def check_point(run, rec, b: int, s: int) -> None:
    """The package at (b, s) against the same model in fp32 torch with FlexAttention and
    the package's masks, on the GPU (row 0: never padded); bound :data:`CHECK_BOUND`."""
    masks = list(run.packages)
    if not masks or not rec.fits("check", model=run.name, B=b, S=s):
        return
    _, real = run.inputs(b, s)
    ref_side = None
    try:
        _free_cached()
        ref_side = _torch_side(run, "fp32")
        ids = _ids(run, b, s)[:1]
        for mask in masks:
            start = time.time()
            got = plain_output(run, "stofc", mask, b, s)[:1]
            ref_side.use("flex", *run.layer_masks[mask])
            ref = ref_side.forward(ids, compiled=False).cpu().numpy()
            rel = rel_error(got, ref, real[:1])
            rec.emit(kind="check", model=run.name, mask=mask, B=b, S=s, rel=rel,
                     bound=CHECK_BOUND, passed=bool(rel <= CHECK_BOUND),
                     ref="fp32 torch + FlexAttention (package masks)",
                     s=round(time.time() - start, 1))
    except Exception as err:
        rec.emit(kind="error", step="check", model=run.name, B=b, S=s, err=one_line(err))
    finally:
        ref_side = None
        _free_cached()


def profile_point(run, rec, b: int, s: int) -> None:
    """GPU time split (attention, GEMMs, rest) per side at (b, s): ORT, each package, Flex."""
    from profile_e2e import foreign_kernels, kernel_breakdown, package_entries

    if not cuda():
        rec.emit(kind="skip", step="profile", model=run.name, B=b, S=s,
                 why="rehearsal on the CPU: CUPTI kernels need the GPU")
        return
    feeds, _ = run.inputs(b, s)
    sides = [("ort", None, ort_opener(run))] if run.base is not None else []
    sides += [("stofc", m, stofc_opener(run, m)) for m in run.packages]
    for impl, mask, opener in sides:
        where = dict(model=run.name, mask=mask, impl=impl, B=b, S=s)
        if not rec.fits("profile", **where):
            return
        session = None
        try:
            _free_cached()
            session = opener()
            binding = _binding(session, feeds)
            for _ in range(3):
                session.run_with_iobinding(binding)
            split = kernel_breakdown(lambda s_=session, b_=binding: s_.run_with_iobinding(b_))
            row = _split_row(split)
            if impl == "stofc":
                foreign = foreign_kernels(split["names"], package_entries(run.packages[mask]))
                if foreign:
                    row["foreign_names"] = foreign
            rec.emit(kind="profile", **where, **row)
        except Exception as err:
            rec.emit(kind="error", step="profile", **where, err=one_line(err))
        finally:
            session = None
            gc.collect()
    for mask in run.packages:
        where = dict(model=run.name, mask=mask, impl="flex", B=b, S=s)
        if not rec.fits("profile", **where):
            return
        try:
            side = _torch_side(run)
            side.compile(b, s, None, side.use("flex", *_at_length(run.layer_masks[mask], s)))
            ids = _ids(run, b, s)
            for _ in range(3):
                side.forward(ids)
            split = kernel_breakdown(lambda s_=side, i_=ids: s_.forward(i_))
            rec.emit(kind="profile", **where, **_split_row(split))
        except Exception as err:
            rec.emit(kind="error", step="profile", **where, err=one_line(err))


def _split_row(split: dict) -> dict:
    parts = split["split_ms"]
    return dict(attention_ms=parts["attention"], gemm_ms=parts["gemm"], other_ms=parts["other"],
                gpu_busy_ms=split["gpu_busy_ms"], wall_ms=split["wall_ms"],
                kernels_per_run=split["kernels_per_run"], top=split["top"][:12],
                timeline=split.get("timeline"))
