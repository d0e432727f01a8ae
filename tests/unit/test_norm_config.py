"""The Add+Norm family's default config and search space (``stofc.kernels.norm``).

The default gives each thread one 16-byte vector of the row where the row allows it (up to
512 threads), in whole warps, so BERT-base's 768 takes three warps and no lane is idle; the
space holds the three-warp multiples beside the powers of two. Measured behind the rule:
``bench/results/add-norm-configs-h100-2026-11-27.jsonl`` (H100).
"""

from __future__ import annotations

import pytest

from stofc.compile.nvrtc import compile_source
from stofc.kernels.epilogue import Epilogue
from stofc.kernels.norm import NormConfig, NormProblem, default_config, render_norm, space

EP = Epilogue(residual=True, norm="layernorm")


@pytest.mark.parametrize(("n", "config", "items"), [
    (64, NormConfig(32, 4), 1),        # 8 vectors: one warp, most lanes idle (a row is small)
    (768, NormConfig(96, 2), 1),       # BERT-base: 96 vectors, three warps, none idle
    (1024, NormConfig(128, 1), 1),
    (1536, NormConfig(192, 1), 1),
    (4096, NormConfig(512, 1), 1),     # the widest one-vector row
    (8192, NormConfig(512, 1), 2),     # beyond: two vectors a thread
    (200, NormConfig(32, 4), 1),       # 25 vectors
    (512, NormConfig(64, 2), 1),
])
def test_default_gives_each_thread_one_vector_in_whole_warps(n, config, items):
    problem = NormProblem(8192, n, "float16", EP)
    got = default_config(problem)
    assert got == config
    assert got.tpr % 32 == 0 and got.items(n) == items
    assert 128 <= got.tpr * got.rows <= 1024


def test_space_holds_three_warp_rows_and_the_bert_default():
    problem = NormProblem(8192, 768, "float16", EP)
    configs = {(c["tpr"], c["rows"]) for c in space(problem).configs()}
    assert (96, 2) in configs and (96, 1) in configs
    assert (384, 1) not in configs      # three quarters of its lanes would hold nothing
    assert all(t % 32 == 0 for t, _ in configs)


@pytest.mark.parametrize("n", [256, 512, 768, 1024, 1280, 1536, 2560, 3072, 4096, 5120, 8192])
def test_the_default_is_in_the_space(n):
    """So the tuner measures the config an untuned package runs (it substitutes the space's
    first config for a default the space lacks)."""
    problem = NormProblem(8192, n, "float16", EP)
    d = default_config(problem)
    assert (d.tpr, d.rows) in {(c["tpr"], c["rows"]) for c in space(problem).configs()}


@pytest.mark.slow  # one NVRTC compile
def test_three_warp_default_compiles():
    problem = NormProblem(8192, 768, "float16", EP)
    src = render_norm(problem, default_config(problem))
    assert "TPR = 96, ROWS = 2, ITEMS = 1" in src.code
    kernel = compile_source(src, "sm_90")
    assert kernel.binary[:4] == b"\x7fELF" and src.name.encode() in kernel.binary
