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
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stofc.errors import DeviceError, StofcError
from stofc.frontend import ModelGraph, load_model
from stofc.package.load import CPU_EP, CUDA_EP, device_compute_capability, load, read_plan_document
from stofc.package.verify import make_inputs, original_model


@dataclass(frozen=True)
class Timing:
    name: str
    batch: int
    seq_len: int
    median_ms: float
    p10_ms: float
    p90_ms: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def require_cuda() -> None:
    """Raise DeviceError unless onnxruntime has the CUDA provider and a GPU is present."""
    try:
        import onnxruntime as ort
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
    from onnxruntime.transformers.optimizer import optimize_model

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
    import onnxruntime as ort

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
    binding = device_binding(session, feeds)
    for _ in range(warmup):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[0], q[-1]


def bench_package(package: str | Path, *, model: str | Path | None, cases: list[tuple[int, int]],
                  warmup: int = 10, repeat: int = 50, seed: int = 0) -> list[Timing]:
    """Time the package and the optimised original on every ``(batch, seq_len)``."""
    import onnxruntime as ort

    require_cuda()
    package = Path(package)
    doc = read_plan_document(package)
    source = original_model(package, doc, model)
    graph = load_model(source)
    pkg = load(package, providers=[CUDA_EP, CPU_EP])
    rng = np.random.default_rng(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="stofc-bench-") as tmp:
        base = ort.InferenceSession(str(optimized_baseline(graph, source, Path(tmp))),
                                    providers=[CUDA_EP, CPU_EP])
        for batch, seq_len in cases:
            feeds, _ = make_inputs(graph, batch, seq_len, rng)
            for name, session in (("stofc", pkg), ("ort-optimized", base)):
                try:
                    med, p10, p90 = time_session(session, feeds, warmup=warmup, repeat=repeat)
                except Exception as err:  # ORT's exception types: keep one line
                    lines = str(err).strip().splitlines()
                    raise StofcError(f"ONNX Runtime failed running {name} at batch {batch}, "
                                     f"length {seq_len} on the CUDA EP: "
                                     f"{(lines[0] if lines else type(err).__name__)[:300]}",
                                     hint="see OPS.md for which CUDA twins are wired") from None
                results.append(Timing(name, batch, seq_len, med, p10, p90))
    return results


def plot(results: list[Timing], path: Path) -> Path:
    """A bar chart of median latency per case (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(t.batch, t.seq_len) for t in results})
    names = sorted({t.name for t in results})
    fig, ax = plt.subplots(figsize=(1.6 * len(cases) + 2, 3.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next((t.median_ms for t in results if t.name == name and (t.batch, t.seq_len) == c),
                   0.0) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], ys, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cases))])
    ax.set_xticklabels([f"B={b}\nL={n}" for b, n in cases])
    ax.set_ylabel("median ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
