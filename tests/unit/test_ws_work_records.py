"""The warp-specialised kernel's work records and its development trace, without a GPU.

The producer resolves each work and hands it to the consumers in a 48-byte record beside
its Q buffer (``block_ws.cu.j2`` ``put_work`` / ``get_work``; ``ws_smem.WORK_RECORD_BYTES``);
the launch's shared memory counts the records, and the template refuses a record too small
for the ``Work`` it copies. ``trace_works`` > 0 renders the kernel ``bench/ws_trace.py``
reads (clock stamps per block, warpgroup and work); the product renders it 0 and its PTX
reads no clock. ``bench/ws_trace.py``'s summary is checked on records built by hand. The
GPU tests (``tests/gpu/test_attention_ws.py``) run the records: many works per block, items
past a short run, empty chunks.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from stofc.codegen import render
from stofc.compile import compile_source
from stofc.errors import StofcError
from stofc.kernels.attention import AttentionConfig, KernelSpec
from stofc.kernels.attention.render import COMPILE_OPTIONS
from stofc.kernels.attention.ws import AttentionWs
from stofc.kernels.attention.ws_smem import WORK_RECORD_BYTES, _ring_bytes, ws_q_buffers

ROOT = Path(__file__).resolve().parents[2]


def _spec(consumers: int = 4, stages: int = 6, head_dim: int = 64) -> KernelSpec:
    cfg = AttentionConfig("ws", 64, 16, 4 * (consumers + 1), stages, 1, mma="wgmma")
    return KernelSpec(cfg, "float16", head_dim)


def _ptx(spec: KernelSpec, **over) -> str:
    values = {**AttentionWs().template_values(spec), **over}
    src = render(spec.template, spec.name, (spec.name, spec.name + "_combine"), **values)
    return compile_source(src, "compute_90a", options=COMPILE_OPTIONS).binary.decode()


@pytest.mark.parametrize(("stages", "head_dim", "consumers"), [(6, 64, 4), (2, 128, 3),
                                                               (4, 64, 2), (2, 256, 2)])
def test_the_ring_counts_one_record_per_q_buffer(stages, head_dim, consumers):
    q_bufs = ws_q_buffers(stages, head_dim, consumers)
    with_records = _ring_bytes(stages, head_dim, consumers, q_bufs)
    without = with_records - q_bufs * WORK_RECORD_BYTES
    panels = head_dim // 64
    assert without == (q_bufs * panels * 64 * consumers * 128 + stages * 2 * panels * 64 * 128
                       + stages * consumers * 512 + (4 * stages + 2 * q_bufs) * 8)
    assert WORK_RECORD_BYTES == 48 and AttentionWs().template_values(
        _spec(consumers, stages, head_dim))["work_record_bytes"] == WORK_RECORD_BYTES


def test_the_template_refuses_a_record_smaller_than_a_work():
    spec = _spec()
    with pytest.raises(StofcError, match="a work record: three 16-byte words"):
        _ptx(spec, work_record_bytes=32)


def test_the_product_kernel_reads_no_clock_and_the_traced_one_does():
    spec = _spec()
    assert AttentionWs().template_values(spec)["trace_works"] == 0
    plain = _ptx(spec)
    traced = _ptx(spec, trace_works=4)
    assert "%globaltimer" not in plain and "%clock64" not in plain
    assert "%globaltimer" in traced and "%clock64" in traced
    # the trace array (PTX declares its bytes): [160 blocks][C + 1][works][8] u64 records,
    # then [160][8] block headers; one u64 in the product
    size = re.compile(rf"\.b8 {spec.name}_trace\[(\d+)\]")
    assert int(size.search(traced).group(1)) == (160 * 5 * 4 + 160) * 8 * 8
    assert int(size.search(plain).group(1)) == 8
    # per step: [160][C][works][32 steps][2] u32 cycle offsets; one u32 in the product
    steps = re.compile(rf"\.b8 {spec.name}_steps\[(\d+)\]")
    assert int(steps.search(traced).group(1)) == 160 * 4 * 4 * 32 * 2 * 4
    assert int(steps.search(plain).group(1)) == 4


def _ws_trace():
    """bench/ws_trace.py as a module (it imports CuPy only to run)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ws_trace
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return ws_trace


def test_trace_summary_of_hand_made_records():
    """Two blocks, two consumers, two works each: the phases, the shares and the block that
    finished last come out as built."""
    mod = _ws_trace()
    C, works = 2, mod.TRACE_WORKS
    rec = np.zeros((mod.TRACE_BLOCKS, C + 1, works, 8), np.uint64)
    head = np.zeros((mod.TRACE_BLOCKS, 8), np.uint64)
    for b in range(2):
        head[b] = [b, 1000, 1000 + 20000 + 1000 * b, 0, 40000 + 2000 * b, 0, 0, 0]
        for w in range(1, C + 1):
            t = 100
            for k in range(2):
                # start, Q (+300), steps (+15000: 10 walked, 8 computed), end (+2000)
                rec[b, w, k] = [k, t, t + 300, t + 15300, t + 17300, 700, 0, (10 << 32) | 8]
                t += 17500
        rec[b, 0, 0] = [0, 50, 80, 9000, 400, 10, 0, 0]
    out = mod.summarise(rec, head, C)
    assert out["blocks"] == 2 and out["works"] == 4
    assert out["clock_ghz"] == 2.0
    assert out["per_work_cycles"]["q_wait"] == 300 and out["per_work_cycles"]["steps"] == 15000
    assert out["per_work_cycles"]["epilogue"] == 2000
    assert out["per_work_cycles"]["gap_to_next"] == 200
    assert out["cycles_per_computed_step"] == 15000 / 8
    assert out["cycles_per_walked_step"] == 1500
    assert out["last_block"]["block"] == 1 and out["span_us"] == 21.0
    assert out["producer_per_work_cycles"]["slot_wait"] == 400
