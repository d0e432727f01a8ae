"""One bound attention launch checked against a reference and timed (GPU benches).

Shared by ``bench/selector_ab.py`` and ``bench/ws_variants.py``: both run a bound
``AttentionOp`` launch once into ``out`` (NaN-filled by the caller), compare it with an fp32
reference, then time it with Triton's ``do_bench`` (median of 100 after 25 warm-up runs).
:func:`cupy_view` is how every attention bench hands torch tensors to ``AttentionOp.bind``.
"""

from __future__ import annotations

# The attention benches' short mask names (ws_variants, ws_trace, selector_ab, ws_calibrate;
# any other name is passed to ``stofc.masks.encode`` as it is: "dense", "causal", ...)
MASKS = {"local64": "sliding:window=64", "local256": "sliding:window=256",
         "longformer": "longformer:window=256,global=16",
         "bigbird": "bigbird:block=64,window=3,global=2,random=3,seed=0",
         "dilated": "dilated:window=256,dilation=2", "cw4095": "sliding:window=4095,causal=true"}


def cupy_view(x):
    """A CuPy view (no copy) of a float16 or bfloat16 torch tensor on the GPU, as
    ``AttentionOp.bind`` takes it: float16 as it is, bfloat16 as its 16-bit pattern
    (``uint16``; CuPy has no bfloat16)."""
    import cupy as cp
    import torch

    if x.dtype == torch.float16:
        return cp.asarray(x)
    return cp.asarray(x.view(torch.int16)).view(cp.uint16)


def check_and_time(bound, stream, out, ref, flops: float) -> tuple[float, float, float]:
    """(TFLOP/s on ``flops``, relative L2 error of ``out`` against ``ref`` (nan without one),
    median us) of ``bound.launch(stream)``. The error is the larger of the first launch's
    and of a launch after the timed ones into an ``out`` reset to NaN, so state a launch
    leaves behind (a counter not reset) cannot pass unseen."""
    import torch
    from triton.testing import do_bench

    def error() -> float:
        bound.launch(stream)
        torch.cuda.synchronize()
        return float("nan") if ref is None else ((out.float() - ref).norm() / ref.norm()).item()

    first = error()
    ms = do_bench(lambda: bound.launch(stream), warmup=25, rep=100, return_mode="median")
    out.fill_(float("nan"))
    after = error()
    err = max(first, after) if after == after else after     # NaN (a row never written) wins
    return round(flops / ms / 1e9, 1), round(err, 4), round(ms * 1e3, 1)
