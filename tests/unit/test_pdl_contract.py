"""The kernels the ORT twins launch with programmatic dependent launch keep pdl.cuh's contract.

``cuda/ort/cuda_driver.h`` ``launch_kernel(..., waits_on_grid=true)`` launches the
warp-specialised attention kernel and its combine, the Add+Norm kernel and the Hopper GEMM
with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` on sm_90: their blocks may start
while the previous kernel still runs, so each must call ``pdl_wait()`` before it touches global
memory another kernel of the run writes or reads. These tests read the rendered sources: the
wait comes before the first such access of every variant the golden renders use, the trigger
comes after the wait, and the guard keeps both out of pre-sm_90 code.
"""

from __future__ import annotations

import re

import pytest

from stofc.kernels import gemm_ws as gemm_ws_family
from stofc.kernels import norm as norm_family
from stofc.kernels.attention import AttentionConfig, KernelSpec, render_kernel
from stofc.kernels.epilogue import Epilogue
from stofc.paths import cuda_dir


def _body(code: str, entry: str) -> str:
    """The source of kernel ``entry``: from its name in the definition to the next kernel."""
    start = code.index(f"{entry}(")
    nxt = code.find('extern "C" __global__', start)
    return code[start:nxt if nxt > 0 else len(code)]


def _before(body: str, first: str, *accesses: str) -> None:
    """``first`` precedes every access found; at least one of them is in ``body``."""
    at = body.index(first)
    hits = {access: body.find(access) for access in accesses}
    assert any(h >= 0 for h in hits.values()), f"none of {accesses} in the kernel"
    for access, hit in hits.items():
        assert hit < 0 or at < hit, f"{first!r} after {access!r}"


def _ws_sources():
    A = AttentionConfig
    for cfg, dtype, d in ((A("ws", 64, 16, 12, 2, mma="wgmma"), "float16", 128),
                          (A("ws", 64, 16, 16, 3, mma="wgmma", split=8), "float16", 64),
                          (A("ws", 64, 16, 12, 4, mma="wgmma", split=16, pingpong=False, kstep=2),
                           "bfloat16", 64)):
        spec = KernelSpec(cfg, dtype, d, has_key_bits=True)
        yield spec.name, render_kernel(spec).code


@pytest.mark.parametrize("name,code", list(_ws_sources()), ids=lambda v: v[:40])
def test_ws_attention_waits_before_reading_its_inputs(name, code):
    main = _body(code, name)
    # the work list (called, not defined, after the wait) reads kv_len, KeyPrep's; the
    # producer loads q/k/v with the TMA; the consumers write o
    _before(main, "pdl_wait();", "work_at(", "tma_load", "store_rows")
    _before(main, "pdl_wait();", "pdl_launch_dependents();")
    combine = _body(code, f"{name}_combine")
    _before(combine, "pdl_wait();", "part_ml +", "part_o +", "combine +")


@pytest.mark.parametrize("ep,dtype", [
    (Epilogue(residual=True, norm="layernorm"), "float16"),
    (Epilogue(bias=True, act="gelu_tanh"), "float16"),
    (Epilogue(residual=True, norm="rmsnorm"), "bfloat16"),
])
def test_add_norm_waits_before_reading_its_inputs(ep, dtype):
    src = norm_family.render_norm(norm_family.NormProblem(4096, 768, dtype, ep),
                                  norm_family.NormConfig(32, 4))
    (entry,) = src.entry_points
    body = _body(src.code, entry)
    first_global = min(m.start() for m in re.finditer(r"load8\(|\bx\[|residual\[|out\[", body))
    assert body.index("pdl_wait();") < first_global
    _before(body, "pdl_wait();", "pdl_launch_dependents();")


def test_gemm_ws_waits_before_loading_and_storing():
    src = gemm_ws_family.render_gemm_ws(gemm_ws_family.GemmWsProblem("float16", "gelu_erf", True))
    body = _body(src.code, src.entry_points[0])
    _before(body, "pdl_wait();", "tma_load_4d(", "bias + col", "out + ")
    _before(body, "pdl_wait();", "pdl_launch_dependents();")


def test_the_wait_compiles_only_for_sm90_and_newer():
    header = (cuda_dir() / "stofc" / "pdl.cuh").read_text()
    for instr in ('"griddepcontrol.wait;', '"griddepcontrol.launch_dependents;'):
        at = header.index(instr)
        guard = header.rfind("#if", 0, at)
        assert "defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900" in header[guard:at], instr
        assert header.find("#endif", at) < header.find("}", at), instr
