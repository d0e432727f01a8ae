"""``stofc bench``: end-to-end latency of a package vs ORT's optimised original, CUDA EP.

Both sides run in ONNX Runtime with IOBinding: inputs copied to the GPU once
(``OrtValue`` on ``cuda:0``), outputs allocated by ORT on the device, so the
timed loop holds no host transfer. The baseline is the original model run
through ``onnxruntime.transformers.optimizer.optimize_model`` (model type
``bert``, or ``gpt2`` for a causal graph; ``use_gpu=True``) and converted to
float16 with float32 inputs/outputs kept. ONNX Runtime cannot take a
structured mask except as a dense additive bias, so the baseline attends
densely: its time is a lower bound for ORT with the mask.

Timing: ``warmup`` runs, then ``repeat`` runs each timed with
``time.perf_counter`` around ``run_with_iobinding`` (which returns after ORT
synchronised its stream); the median is reported, with p10/p90. Needs
onnxruntime-gpu and a GPU: otherwise one clear DeviceError line.

Memory: each side runs every case in a fresh session whose CUDA arena grows by what is
asked (``arena_extend_strategy=kSameAsRequested``); ``peak_mib`` is the device memory in
use after its timed runs minus before the session was created (``cudaMemGetInfo``
through CuPy: weights, arena high-water mark, workspaces). At long lengths ORT's dense
attention may not fit: its failure is recorded (``BenchResult.failures``) and the
package's row still stands.

CUDA graphs (``cuda_graph=True``): each side is also timed with ONNX Runtime's
``enable_cuda_graph`` provider option, one fresh session per shape (ORT captures one
fixed shape), inputs and outputs bound once at fixed device buffers
(:func:`time_graph`). At small shapes a plain session is bound by host launch
overhead, so this is the figure a latency-sensitive deployment sees. Each graph
replay's outputs are checked against the plain session's (relative difference <=
:data:`GRAPH_TOLERANCE`, else a StofcError: a capture that computes something else
must not be timed). ORT refuses capture when its optimizer left nodes on the CPU
provider (GPT-2 exports): the refusal is returned as a :class:`Refusal`, not hidden.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stofc.errors import DeviceError, StofcError
from stofc.frontend import ModelGraph, load_model
from stofc.package.load import CPU_EP, CUDA_EP, device_compute_capability, load, read_plan_document
from stofc.package.verify import make_inputs, original_model

GRAPH_TOLERANCE = 1e-3   # graph replay vs plain run, relative (same kernels: ~0 in practice)


@dataclass(frozen=True)
class Timing:
    name: str
    batch: int
    seq_len: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    graph: bool = False      # timed as CUDA-graph replays (``enable_cuda_graph``)
    peak_mib: float | None = None  # device memory the session held after its runs (plain)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Refusal:
    """A side ONNX Runtime would not capture in a CUDA graph at one shape, and why."""

    name: str
    batch: int
    seq_len: int
    reason: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BenchResult:
    timings: list[Timing]
    refusals: list[Refusal]
    failures: tuple[Refusal, ...] = ()   # ORT's optimised model failing a plain run (e.g. OOM)

    def get(self, name: str, batch: int, seq_len: int, graph: bool) -> Timing | None:
        return next((t for t in self.timings if (t.name, t.batch, t.seq_len, t.graph)
                     == (name, batch, seq_len, graph)), None)


def require_cuda() -> None:
    """Raise DeviceError unless onnxruntime has the CUDA provider and a GPU is present."""
    try:
        import onnxruntime as ort  # optional: ONNX Runtime
    except ImportError:
        raise DeviceError("onnxruntime is not installed",
                          hint="pip install onnxruntime-gpu on a GPU machine") from None
    if CUDA_EP not in ort.get_available_providers():
        raise DeviceError(f"stofc bench needs onnxruntime-gpu, and this onnxruntime "
                          f"{ort.__version__} has no CUDAExecutionProvider",
                          hint="pip install onnxruntime-gpu on a machine with an NVIDIA GPU")
    if device_compute_capability() is None:
        raise DeviceError("stofc bench needs a CUDA GPU and none was found",
                          hint="run it on the GPU the package was compiled for")


def optimized_baseline(graph: ModelGraph, source: Path, work: Path) -> Path:
    """The original optimised by ORT's transformer optimizer, float16, IO types kept."""
    from onnxruntime.transformers.optimizer import optimize_model  # optional: ONNX Runtime

    block = graph.layers[0].attention
    model_type = "gpt2" if block.causal_in_graph else "bert"
    opt = optimize_model(str(source), model_type=model_type, num_heads=block.num_heads,
                         hidden_size=block.hidden_size, use_gpu=True)
    opt.convert_float_to_float16(keep_io_types=True)
    path = work / "baseline.onnx"
    opt.save_model_to_file(str(path), use_external_data_format=opt.model.ByteSize() > (1 << 30))
    return path


def device_binding(session, feeds: dict[str, np.ndarray]):
    """An IOBinding with ``feeds`` copied to ``cuda:0`` once and every output left on the GPU."""
    import onnxruntime as ort  # optional: ONNX Runtime

    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
    for out in session.get_outputs():
        binding.bind_output(out.name, "cuda")
    binding.synchronize_inputs()
    return binding


def time_session(session, feeds: dict[str, np.ndarray], *, warmup: int,
                 repeat: int) -> tuple[float, float, float]:
    """Median, p10, p90 ms of ``run_with_iobinding`` with device-resident IO."""
    return timed_runs(session, device_binding(session, feeds), warmup=warmup, repeat=repeat)


def timed_runs(session, binding, *, warmup: int, repeat: int) -> tuple[float, float, float]:
    """``warmup`` untimed runs of ``binding``, then median, p10, p90 ms of ``repeat`` timed."""
    for _ in range(warmup):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[0], q[-1]


_NUMPY_OF = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
             "tensor(double)": np.float64, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def graph_providers() -> list:
    """The CUDA EP with ONNX Runtime's CUDA-graph capture on, then the CPU EP."""
    return [(CUDA_EP, {"enable_cuda_graph": "1"}), CPU_EP]


@dataclass(frozen=True, eq=False)
class GraphIO:
    """A CUDA-graph session's IOBinding at fixed device buffers (:func:`graph_binding`)."""

    binding: Any            # onnxruntime.IOBinding
    inputs: tuple           # the input OrtValues, kept alive at their captured addresses
    outputs: dict           # output name -> preallocated OrtValue
    poison: dict            # output name -> the NaN / -1 array written before a checked replay


def graph_binding(session, feeds: dict[str, np.ndarray],
                  out_shapes: dict[str, tuple]) -> GraphIO:
    """Inputs and outputs bound once at fixed device buffers, as ORT's CUDA graph needs.

    ORT replays a captured graph on the addresses it captured, so outputs are bound to
    preallocated OrtValues of ``out_shapes`` (not ORT-allocated each run), filled with
    NaN (floats) or -1 first.
    """
    import onnxruntime as ort  # optional: ONNX Runtime

    binding = session.io_binding()
    keep = []
    for name, value in feeds.items():
        v = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        keep.append(v)
        binding.bind_ortvalue_input(name, v)
    outs, poison = {}, {}
    for o in session.get_outputs():
        dtype = _NUMPY_OF.get(o.type)
        if dtype is None:
            raise StofcError(f"output {o.name!r} has type {o.type}, which the CUDA-graph "
                             "timing cannot preallocate", hint="time without --cuda-graph")
        fill = np.nan if np.issubdtype(dtype, np.floating) else -1
        poison[o.name] = np.full(out_shapes[o.name], fill, dtype)
        outs[o.name] = ort.OrtValue.ortvalue_from_numpy(poison[o.name], "cuda", 0)
        binding.bind_ortvalue_output(o.name, outs[o.name])
    binding.synchronize_inputs()
    return GraphIO(binding, tuple(keep), outs, poison)


def replay_outputs(session, io: GraphIO) -> dict[str, np.ndarray]:
    """Poison the outputs, replay once and return what that replay wrote."""
    for name, value in io.outputs.items():
        value.update_inplace(io.poison[name])
    session.run_with_iobinding(io.binding)
    io.binding.synchronize_outputs()
    return {k: v.numpy() for k, v in io.outputs.items()}


def time_graph(session, feeds: dict[str, np.ndarray], out_shapes: dict[str, tuple], *,
               warmup: int, repeat: int) -> tuple[float, float, float, dict[str, np.ndarray]]:
    """:func:`time_session` for a CUDA-graph session (:func:`graph_binding`).

    After timing, the outputs are poisoned again and replayed once more: the outputs
    returned are that replay's (the caller compares them with a plain run's). Returns
    median, p10, p90 ms and those outputs.
    """
    io = graph_binding(session, feeds, out_shapes)
    med, p10, p90 = timed_runs(session, io.binding, warmup=warmup, repeat=repeat)
    return med, p10, p90, replay_outputs(session, io)


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """``max|a - b| / max(max|b|, tiny)`` in float64; inf when ``a`` has a non-finite value."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a64).all():
        return float("inf")
    scale = max(float(np.abs(b64).max(initial=0.0)), 1e-30)
    return float(np.abs(a64 - b64).max(initial=0.0)) / scale


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:300]


def memory_providers() -> list:
    """The CUDA EP growing its arena by what is asked (not by powers of two), then the CPU
    EP: the device memory a session holds after its runs is then close to its peak need."""
    return [(CUDA_EP, {"arena_extend_strategy": "kSameAsRequested"}), CPU_EP]


def device_memory_used() -> int | None:
    """Bytes in use on CUDA device 0 (every allocation of the process, through CuPy's
    ``cudaMemGetInfo``), or None when it cannot be read."""
    try:
        import cupy  # optional: CuPy, the GPU extras

        free, total = cupy.cuda.runtime.memGetInfo()
    except Exception:
        return None
    return int(total - free)


def _timed_fresh(name: str, open_session, feeds: dict[str, np.ndarray], batch: int,
                 seq_len: int, *, warmup: int, repeat: int,
                 outputs: bool) -> tuple[Timing, dict[str, np.ndarray]]:
    """One side at one shape in a fresh session: its Timing with the device memory the
    session holds after the timed runs (``peak_mib``: the arena keeps its high-water
    mark), and its plain outputs if asked."""
    gc.collect()
    before = device_memory_used()
    session = open_session()
    try:
        med, p10, p90 = time_session(session, feeds, warmup=warmup, repeat=repeat)
        after = device_memory_used()
        plain = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds),
                         strict=True)) if outputs else {}
    finally:
        del session
        gc.collect()
    peak = None if before is None or after is None else round((after - before) / 2**20, 1)
    return Timing(name, batch, seq_len, med, p10, p90, peak_mib=peak), plain


def bench_package(package: str | Path, *, model: str | Path | None, cases: list[tuple[int, int]],
                  warmup: int = 10, repeat: int = 50, seed: int = 0,
                  cuda_graph: bool = False) -> BenchResult:
    """Time the package and the optimised original on every ``(batch, seq_len)``.

    Each side runs in a fresh session per case, so its ``peak_mib`` is its own. ORT's
    optimised model failing a case (out of memory at long lengths) is recorded in
    ``failures`` and the other cases go on; the package failing is a StofcError. With
    ``cuda_graph`` each side is also timed as CUDA-graph replays (module doc).
    """
    import onnxruntime as ort  # optional: ONNX Runtime

    require_cuda()
    package = Path(package)
    doc = read_plan_document(package)
    max_len = doc.plan.max_seq_len
    longest = max(n for _, n in cases)
    if longest > max_len:
        raise StofcError(f"--seq-len {longest} exceeds the package's max_seq_len {max_len}",
                         hint=f"compile it with --max-seq-len {longest}, or use lengths <= "
                              f"{max_len}")
    source = original_model(package, doc, model)
    graph = load_model(source)
    rng = np.random.default_rng(seed)
    timings: list[Timing] = []
    refusals: list[Refusal] = []
    failures: list[Refusal] = []
    with tempfile.TemporaryDirectory(prefix="stofc-bench-") as tmp:
        base_path = optimized_baseline(graph, source, Path(tmp))

        def base(providers):
            return ort.InferenceSession(str(base_path), providers=providers)

        openers = {"stofc": lambda p: load(package, providers=p), "ort-optimized": base}
        for batch, seq_len in cases:
            feeds, _ = make_inputs(graph, batch, seq_len, rng)
            for name, opener in openers.items():
                try:
                    timing, plain = _timed_fresh(
                        name, lambda o=opener: o(memory_providers()), feeds, batch, seq_len,
                        warmup=warmup, repeat=repeat, outputs=cuda_graph)
                except Exception as err:  # ORT's exception types: keep one line
                    if name == "stofc":
                        raise StofcError(f"ONNX Runtime failed running {name} at batch {batch}, "
                                         f"length {seq_len} on the CUDA EP: {_one_line(err)}",
                                         hint="see OPS.md for which CUDA twins are wired") from None
                    failures.append(Refusal(name, batch, seq_len, _one_line(err)))
                    continue
                timings.append(timing)
                if cuda_graph:
                    result = _time_graph_side(name, lambda o=opener: o(graph_providers()), feeds,
                                              plain, batch, seq_len, warmup=warmup, repeat=repeat)
                    if isinstance(result, Timing):
                        timings.append(result)
                    else:
                        refusals.append(result)
    return BenchResult(timings, refusals, tuple(failures))


def _time_graph_side(name: str, open_session, feeds: dict[str, np.ndarray],
                     plain: dict[str, np.ndarray], batch: int, seq_len: int, *, warmup: int,
                     repeat: int) -> Timing | Refusal:
    """One side's CUDA-graph timing at one shape (a fresh session), checked against ``plain``."""
    session = None
    try:
        session = open_session()
        med, p10, p90, outs = time_graph(session, feeds, {k: v.shape for k, v in plain.items()},
                                         warmup=warmup, repeat=repeat)
    except StofcError:
        raise
    except Exception as err:  # ORT refuses capture with its own exception types
        return Refusal(name, batch, seq_len, _one_line(err))
    finally:
        del session
        gc.collect()
    for out, value in outs.items():
        diff = relative_difference(value, plain[out])
        if not diff <= GRAPH_TOLERANCE:
            raise StofcError(f"{name}'s CUDA-graph replay at batch {batch}, length {seq_len} "
                             f"gives output {out!r} {diff:.3g} (relative) away from its plain "
                             f"run, beyond {GRAPH_TOLERANCE:g}",
                             hint="time without --cuda-graph and report the package to stofc")
    return Timing(name, batch, seq_len, med, p10, p90, graph=True)


def plot(results: list[Timing], path: Path) -> Path:
    """A bar chart of median latency per case and side (PNG); CUDA-graph timings are their
    own bars (``NAME (CUDA graph)``)."""
    import matplotlib  # optional: matplotlib, only for pictures
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib, only for pictures

    def label(t: Timing) -> str:
        return f"{t.name} (CUDA graph)" if t.graph else t.name

    cases = sorted({(t.batch, t.seq_len) for t in results})
    names = sorted({label(t) for t in results})
    fig, ax = plt.subplots(figsize=(1.6 * len(cases) + 2, 3.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next((t.median_ms for t in results if label(t) == name
                    and (t.batch, t.seq_len) == c), 0.0) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], ys, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cases))])
    ax.set_xticklabels([f"B={b}\nL={n}" for b, n in cases])
    ax.set_ylabel("median ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
