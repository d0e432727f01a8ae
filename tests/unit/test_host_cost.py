"""The CUDA twins' host work per run (issue 18, "no latency lost at short inputs").

A compiled package (two layers, the warp-specialised attention kernel, cuBLASLt GEMMs,
Add+Norm kernels, KeyPrep) runs in ONNX Runtime against the recording fake driver
(tests/unit/test_ortlib_fake_gpu.py). The first run of a shape does the first-use and
per-shape work; a second and third run of the same shape make exactly the launches of
the first and no other driver or cuBLASLt call: no module load, allocation, upload,
tensor-map encode, context query, cuBLASLt descriptor, layout or heuristic. A new shape
derives its own launch parameters (tensor maps, the GEMMs' algorithm for the new M) and
nothing else; going back to a shape seen before derives nothing again.
"""

from __future__ import annotations

import itertools
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from stofc.package.ortlib import sources_dir
from stofc.pipeline import Instruments, compile_model
from tests.unit.test_ortlib_fake_gpu import run

ROOT = Path(__file__).resolve().parents[2]
STEADY = {"launch", "lt_matmul"}       # all a run of a shape seen before may do
FIRST_USE = {"module_load", "mem_alloc", "htod", "device_attr", "func_attr", "lt_create"}


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model

    root = tmp_path_factory.mktemp("hostcost")
    model = root / "model.onnx"
    onnx.save(build_model(layers=2, hidden=256, heads=4, seq=512), str(model))
    return compile_model(model, "sliding:window=256", gpu="h100", max_seq_len=512,
                         out_dir=root / "pkg", instruments=Instruments(progress=False),
                         seq_lens=())


def _per_run(records) -> list[list[dict]]:
    starts = [i for i, r in enumerate(records) if r["call"] == "run"] + [len(records)]
    return [records[a + 1:b] for a, b in itertools.pairwise(starts)]


def _launches(recs) -> list[tuple]:
    return [(r["fn"], tuple(r["grid"]), tuple(r["block"]), r["smem"]) if r["call"] == "launch"
            else ("lt_matmul",) for r in recs if r["call"] in STEADY]


def test_steady_runs_make_only_their_launches(fake, package, tmp_path):
    work = tmp_path / "pkg"
    shutil.copytree(package, work)
    model = onnx.load(str(work / "model.onnx"))
    ops = [n.op_type for n in model.graph.node if n.domain == "ai.stofc"]
    epilogues = sum(1 for n in model.graph.node if n.op_type == "FusedGemm"
                    and any(a.name == "epilogue_kernel" and a.s for a in n.attribute))
    rng = np.random.default_rng(0)
    shapes = [(1, 128)] * 3 + [(2, 300)] * 2 + [(1, 128)]
    feeds = [{"input_ids": rng.integers(0, 1000, (B, S)).astype(np.int64),
              "attention_mask": np.ones((B, S), np.int64)} for B, S in shapes]
    code, out, records = run(fake, work, model, feeds)
    assert code == 0, out
    runs = _per_run(records)
    assert len(runs) == len(shapes)
    kinds = [[r["call"] for r in recs] for recs in runs]

    # the first run: first use (modules, plan upload, cuBLASLt handle) and the shape's work
    first = set(kinds[0])
    assert {"module_load", "mem_alloc", "htod", "lt_create", "tensor_map",
            "lt_heuristic", "stream_ctx"} <= first, first
    n_attn = ops.count("SparseAttention")
    assert kinds[0].count("tensor_map") == 3 * n_attn        # q, k, v per ws launch
    # exactly one launch per kernel: KeyPrep, attention, Add+Norm, the GEMM epilogues
    attn = [r for r in runs[0] if r["call"] == "launch" and r["fn"].startswith("stofc_attn_ws")]
    assert len(attn) == n_attn and not any(r["fn"].endswith("_combine") for r in attn)
    assert kinds[0].count("launch") == (ops.count("KeyPrep") + n_attn
                                        + ops.count("AddLayerNorm") + epilogues)
    assert kinds[0].count("lt_matmul") == ops.count("FusedGemm")

    # the same shape again: its launches and nothing else, twice
    for i in (1, 2):
        assert set(kinds[i]) <= STEADY, (i, sorted(set(kinds[i]) - STEADY))
        assert _launches(runs[i]) == _launches(runs[0])

    # a new shape: its own tensor maps and GEMM algorithms (new M), no first-use work
    assert not FIRST_USE & set(kinds[3]), kinds[3]
    assert kinds[3].count("tensor_map") == 3 * n_attn
    assert kinds[3].count("lt_heuristic") >= 1
    assert set(kinds[4]) <= STEADY and _launches(runs[4]) == _launches(runs[3])
    assert _launches(runs[3]) != _launches(runs[0])            # grids follow the shape

    # back to the first shape: everything it derived is still kept
    assert not (FIRST_USE | {"lt_heuristic", "lt_desc", "lt_layout", "stream_ctx"}) \
        & set(kinds[5]), kinds[5]
    assert _launches(runs[5]) == _launches(runs[0])


def test_the_library_never_synchronises():
    """No synchronisation entry point is even resolved from the driver, and no source of the
    library calls the runtime API's allocation or synchronisation functions."""
    src = sources_dir()
    table = (src / "cuda_driver.h").read_text()
    assert "Synchronize" not in table and "Sync" not in table.replace("Async", "")
    for path in list(src.glob("*.cc")) + list(src.glob("*.h")):
        text = path.read_text()
        assert not re.search(r"\bcuda(Malloc|Free|DeviceSynchronize|StreamSynchronize)\b",
                             text), path.name
        assert not re.search(r"\bcu(Ctx|Stream|Event)Synchronize\b", text), path.name
