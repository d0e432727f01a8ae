"""NVRTC compilation without a GPU: cubins per arch, PTX, cache keys, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from stofc.codegen import Source
from stofc.compile import compile_source
from stofc.compile.nvrtc import cache_key
from stofc.errors import CompileError, StofcError

GOOD = Source(
    name="probe",
    code='#include <cuda_fp16.h>\nextern "C" __global__ void probe(half* x)'
         ' { x[threadIdx.x] = __float2half(2.0f); }\n',
    template="inline",
    entry_points=("probe",),
)


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"])
def test_cubin_for_every_arch(target, tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path))
    kernel = compile_source(GOOD, target)
    assert kernel.binary[:4] == b"\x7fELF"
    assert not kernel.is_ptx


def test_ptx_target(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path))
    kernel = compile_source(GOOD, "compute_80")
    assert kernel.is_ptx and b".entry probe" in kernel.binary


def test_cache_hit_returns_same_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path))
    first = compile_source(GOOD, "sm_90")
    assert list(tmp_path.rglob("*.cubin.entry"))
    second = compile_source(GOOD, "sm_90")
    assert first.binary == second.binary and first.key == second.key


def test_cache_key_changes_with_everything_that_matters():
    base = cache_key(GOOD, "sm_90", ("--std=c++17",))
    assert cache_key(GOOD, "sm_80", ("--std=c++17",)) != base
    assert cache_key(GOOD, "sm_90", ("--std=c++17", "-lineinfo")) != base
    edited = Source(GOOD.name, GOOD.code + "\n", GOOD.template, GOOD.entry_points)
    assert cache_key(edited, "sm_90", ("--std=c++17",)) != base


def test_compile_error_has_log_and_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_DUMP_DIR", str(tmp_path))
    bad = Source("broken", 'extern "C" __global__ void k() { undefined_name; }', "inline", ("k",))
    with pytest.raises(CompileError) as info:
        compile_source(bad, "sm_80", use_cache=False)
    err = info.value
    assert "undefined_name" in err.log
    assert err.source_path and err.source_path.startswith(str(tmp_path))
    assert "undefined_name" in Path(err.source_path).read_text()
    assert "\n" not in str(err)


def test_unknown_target_is_user_error():
    with pytest.raises(StofcError, match="unknown compile target"):
        compile_source(GOOD, "gfx90a")
