"""One bound attention launch checked against a reference and timed (GPU benches).

Shared by ``bench/selector_ab.py`` and ``bench/ws_variants.py``: both run a bound
``AttentionOp`` launch once into ``out`` (NaN-filled by the caller), compare it with an fp32
reference, then time it with Triton's ``do_bench`` (median of 100 after 25 warm-up runs).
"""

from __future__ import annotations


def check_and_time(bound, stream, out, ref, flops: float) -> tuple[float, float, float]:
    """(TFLOP/s on ``flops``, relative L2 error of ``out`` against ``ref`` (nan without one),
    median us) of ``bound.launch(stream)``."""
    import torch
    from triton.testing import do_bench

    bound.launch(stream)
    torch.cuda.synchronize()
    err = float("nan") if ref is None else ((out.float() - ref).norm() / ref.norm()).item()
    ms = do_bench(lambda: bound.launch(stream), warmup=25, rep=100, return_mode="median")
    return round(flops / ms / 1e9, 1), round(err, 4), round(ms * 1e3, 1)
