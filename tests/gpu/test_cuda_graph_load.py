"""``stofc.load(pkg, cuda_graph=True)`` on a GPU: ORT captures the package in a CUDA graph
and its replays give the plain session's outputs.

Skipped without a CUDA device (tests/gpu/conftest.py) or without onnxruntime's CUDA EP
(onnxruntime-gpu, bench/ort_env.sh on the GPU machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in ort.get_available_providers():
    pytest.skip("onnxruntime has no CUDAExecutionProvider", allow_module_level=True)

from stofc.package.bench import GRAPH_TOLERANCE, relative_difference, time_graph  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> tuple[Path, Path]:
    from stofc.pipeline import Instruments, compile_model
    from stofc.targets import detect

    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model
    root = tmp_path_factory.mktemp("graph")
    model = root / "model.onnx"
    onnx.save(build_model(seq=512), str(model))
    pkg = compile_model(model, "longformer:window=64,global=1", gpu=detect().name,
                        max_seq_len=256, out_dir=root / "pkg",
                        instruments=Instruments(progress=False))
    return model, pkg


@pytest.mark.parametrize("batch,seq_len", [(1, 128), (2, 256)])
def test_cuda_graph_replays_equal_the_plain_run(package, batch, seq_len):
    from stofc.frontend import load_model
    from stofc.package.load import load
    from stofc.package.verify import make_inputs

    model, pkg = package
    feeds, _ = make_inputs(load_model(model), batch, seq_len, np.random.default_rng(3))
    plain = load(pkg, providers=[CUDA, CPU])
    names = [o.name for o in plain.get_outputs()]
    want = dict(zip(names, plain.run(names, feeds), strict=True))
    graph = load(pkg, cuda_graph=True)
    opts = graph.get_provider_options()[CUDA]
    assert opts.get("enable_cuda_graph") == "1", opts
    _, _, _, got = time_graph(graph, feeds, {k: v.shape for k, v in want.items()},
                              warmup=2, repeat=5)
    for name, value in want.items():
        diff = relative_difference(got[name], value)
        assert diff <= GRAPH_TOLERANCE, (name, diff)
