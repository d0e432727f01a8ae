"""The ws attention's launch chain, timed in parts (a development probe).

For each case the selector's ws config is bound as the product binds it; the probe times,
with CUDA events on one stream (``ws_trace.time_us``, 100 runs): the chain (main kernel,
then the combine of split rows) as
``BoundLaunch.launch`` makes it (``chain_plain``), the same two launches with programmatic
dependent launch as the ORT custom op makes them (``cuLaunchKernelEx`` with
``PROGRAMMATIC_STREAM_SERIALIZATION``, ``chain_pdl``), the main kernel alone
(``main_only``; its output is then incomplete) and the combine alone (``combine_only``).
``pdl_bit_identical``: the PDL chain's output equals the plain chain's. Two rounds each.
Usage: PYTHONPATH=.:bench python3 bench/chain_probe.py ["mask:B:H:L:D:dtype" ...]
"""

from __future__ import annotations

import ctypes
import json
import sys

import cupy as cp
import numpy as np
from attention_timing import MASKS
from ws_trace import rand, time_us

from stofc.kernels.attention.ws_cost import ws_config
from stofc.masks import encode
from stofc.runtime.attention import AttentionOp
from stofc.targets import detect

PROGRAMMATIC_STREAM_SERIALIZATION = 6          # CUlaunchAttributeID


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("n", ctypes.c_uint)]


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
    return lib


def launch_pdl(lib, bound, stream) -> None:
    """``bound`` and its ``then`` launched as the ORT op does (programmatic dependent launch)."""
    attr = _Attr(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.i = 1
    while bound is not None:
        cfg = _LaunchConfig(bound.grid, 1, 1, bound.block, 1, 1, bound.kernel.dynamic_smem,
                            stream.ptr, ctypes.pointer(attr), 1)
        err = lib.cuLaunchKernelEx(ctypes.byref(cfg), bound.kernel.function.ptr,
                                   bound._params_ptr, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed ({err})")
        bound = bound.then


def _us(fn, stream) -> float:
    return round(time_us(fn, stream, reps=100), 2)


def main() -> int:
    cases = sys.argv[1:] or ["longformer:1:12:8192:64:float16", "bigbird:1:12:8192:64:float16",
                             "longformer:1:12:16384:64:float16", "bigbird:2:12:16384:64:float16"]
    lib = _driver()
    profile = detect()
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    for case in cases:
        mask, B, H, L, D, dtype = case.split(":")
        B, H, L, D = int(B), int(H), int(L), int(D)
        fmt = encode(MASKS.get(mask, mask), L)
        cfg = ws_config(fmt, profile, batch=B, heads=H, head_dim=D)
        assert cfg is not None, case
        q, k, v = (rand((B, L, H, D), dtype, rng) for _ in range(3))
        out = cp.zeros_like(q)
        bound = AttentionOp(fmt, cfg, dtype, D, profile).bind(q, k, v, out)
        row: dict = {"case": case, "config": cfg.describe(), "main_grid": bound.grid,
                     "combine_grid": bound.then.grid if bound.then else 0}
        bound.launch(stream)
        stream.synchronize()
        plain = out.copy()
        launch_pdl(lib, bound, stream)
        stream.synchronize()
        row["pdl_bit_identical"] = bool((out == plain).all())
        for rnd in range(2):
            row[f"chain_plain_{rnd}"] = _us(lambda b=bound: b.launch(stream), stream)
            row[f"chain_pdl_{rnd}"] = _us(lambda b=bound: launch_pdl(lib, b, stream), stream)
            then = bound.then
            if then is not None:
                bound.then = None
                row[f"main_only_{rnd}"] = _us(lambda b=bound: b.launch(stream), stream)
                bound.then = then
                row[f"combine_only_{rnd}"] = _us(lambda t=then: t.launch(stream), stream)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
