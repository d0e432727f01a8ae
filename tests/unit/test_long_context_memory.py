"""Memory follows the mask, not L x L (issue 18, part 2), at L = 32768 on the CPU.

* ``stofc compile`` at max_seq_len 32768 for Longformer, BigBird and causal masks
  (ModernBERT fixture: rotary, no position table): model masks, encode, plan, lower,
  compile, check and write stay under a traced-memory bound of L*L/16 bytes (one
  L x L bool array is 1 GiB), and the package's mask files follow the tiles;
* a BERT fixture whose position table is stretched to 32768 rows (HF's own
  ``[B, 1, S, S]`` mask subgraph in the graph) compiles in a child process whose peak
  RSS stays far below the ~22 GB the old full-length mask probe needed;
* the ws kernel's workspace and launch plan follow the split tiles, not L x L.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from stofc import pipeline
from stofc.frontend import load_model
from stofc.kernels.attention.ws_plan import default_split, plan_ws
from stofc.masks import encode
from stofc.package.positions import max_positions
from stofc.pipeline import Instruments, compile_model

L = 32768
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ROOT = Path(__file__).resolve().parents[2]
MASKS = {"longformer": "longformer:window=256,global=16",
         "bigbird": "bigbird:block=64,window=3,global=2,random=3",
         "causal": "causal"}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_compile_at_32k_stays_far_below_l_squared(name, tmp_path, monkeypatch):
    # the model is loaded before tracing (its size does not depend on L; the onnxscript
    # optimiser's many small objects make a traced load take half a minute)
    graph = load_model(FIXTURES / "modernbert_ts_op17.onnx", pack_projections=True)
    monkeypatch.setattr(pipeline, "load_model", lambda *args, **kwargs: graph)
    ins = Instruments(progress=False)
    tracemalloc.start()
    try:
        # seq_lens=(): the base kernels' files alone (each selector bucket pick adds a launch
        # plan per distinct kernel, also linear in the tiles plus its (L/T)^2/2 row orders;
        # the bound below counts two plans)
        out = compile_model(FIXTURES / "modernbert_ts_op17.onnx", MASKS[name],
                            max_seq_len=L, out_dir=tmp_path / "pkg", instruments=ins,
                            seq_lens=())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    stages = ", ".join(f"{n} {s:.2f}" for n, s in ins.timings if s >= 0.05)
    print(f"{name}: compile at L={L} in {sum(s for _, s in ins.timings):.1f} s ({stages}), "
          f"traced peak {peak / 2**20:.1f} MiB")
    assert peak < L * L // 16, f"{name}: traced peak {peak} bytes"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["plan"]["max_seq_len"] == L
    fmt = encode(MASKS[name], L)
    tiles = int(fmt.load_col_idx.size)
    mask_bytes = sum(p.stat().st_size for p in (out / "masks").iterdir())
    # formats and launch plans: indices per tile, bitmaps per part tile, the per-length
    # tile-row orders ((L/T)^2 / 2 int32 per format) and the residue permutation (int32 L)
    rows = fmt.tile_rows
    bound = 3 * (tiles * 12 + fmt.part_bitmaps.nbytes) + 8 * rows * rows + 16 * L + (1 << 20)
    print(f"{name}: mask files {mask_bytes / 2**20:.1f} MiB ({tiles} tiles, bound "
          f"{bound / 2**20:.1f} MiB; L x L bits would be {L * L / 8 / 2**20:.0f} MiB)")
    assert mask_bytes < bound


def test_bert_with_32k_positions_compiles_without_the_l_squared_probe(tmp_path):
    """HF BERT's own mask subgraph (Optimum export, head_dim 32), 32768 positions: the old probe at max_seq_len
    evaluated [1, 1, S, S] floats (~22 GB at 32768); now it fits the family at short
    probes. The child's peak RSS is bounded at 1.5 GiB (one L x L float32 is 4 GiB)."""
    model = onnx.load(str(FIXTURES / "bert_optimum_op18.onnx"))
    table = max_positions(load_model(FIXTURES / "bert_optimum_op18.onnx"))
    assert table is not None
    init = next(t for t in model.graph.initializer if t.name == table.name)
    rows = numpy_helper.to_array(init)
    stretched = np.resize(rows, (L, rows.shape[1])).astype(rows.dtype)
    init.CopyFrom(numpy_helper.from_array(stretched, table.name))
    path = tmp_path / "bert32k.onnx"
    onnx.save(model, str(path))
    script = textwrap.dedent(f"""
        import json, resource, time
        from stofc.pipeline import Instruments, compile_model
        start = time.perf_counter()
        compile_model({str(path)!r}, max_seq_len={L}, out_dir={str(tmp_path / 'pkg')!r},
                      instruments=Instruments(progress=False))
        print(json.dumps({{"s": time.perf_counter() - start,
                          "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={"PYTHONPATH": str(ROOT),
                                                      **_env()})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"BERT fixture, max_seq_len {L}: {result['s']:.1f} s, peak RSS "
          f"{result['rss'] / 2**20:.0f} MiB")
    assert result["rss"] < 1.5 * 2**30


def _env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_ws_workspace_follows_the_split_tiles(name):
    """The ws kernel's row-split scratch is batch x heads x slots x 128 x head_dim floats
    (:class:`stofc.runtime.attention_ws.WsLaunchData`): slots are the split pieces, so
    the scratch and the launch plan follow the tiles walked, far below L x L."""
    fmt = encode(MASKS[name], L)
    tiles = int(fmt.load_col_idx.size)
    split = default_split(fmt, batch=1, heads=12, sm_count=132)
    plan = plan_ws(fmt, split_tiles=split)
    pair_entries = int(plan.entry_key.size)
    if split:       # a row of n > split entries makes ceil(n / split) <= 2 n / split slots
        assert plan.slots <= 2 * pair_entries / split + 1
    else:
        assert plan.slots == 1
    scratch = 12 * plan.slots * plan.rows * (64 + 2) * 4      # part_o + part_ml, 12 heads
    assert scratch < L * L // 4
    plan_bytes = sum(a.nbytes for a in (plan.entry_key, plan.entry_part, plan.bitmaps,
                                        plan.items, plan.orders, plan.combine))
    assert plan_bytes < 64 * (tiles + (L // plan.rows) ** 2) + fmt.part_bitmaps.nbytes
