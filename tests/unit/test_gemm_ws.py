"""The Hopper GEMM (``gemm/gemm_ws.cu.j2``) without a GPU: configs, checks, names, launch
geometry, and NVRTC compiles for sm_90a of every dtype, activation and bias variant of the
default config plus the ping-pong and 128-wide configs the GPU test runs (ptxas must also
find no register spills in the default config: a spill there cost 5-10% on the H100)."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import pytest

from stofc.compile import compile_source
from stofc.errors import PlanError
from stofc.kernels.epilogue import ACTIVATIONS
from stofc.kernels.gemm_ws import (
    DEFAULT,
    SMEM_LIMIT,
    TARGET,
    GemmWsConfig,
    GemmWsProblem,
    check,
    check_shape,
    entry_name,
    gemm_ws_grid,
    gemm_ws_tiles,
    render_gemm_ws,
)

PINGPONG = GemmWsConfig(bn=256, stages=4, coop=False, pass_cols=128)
N128 = GemmWsConfig(bn=128, stages=5, coop=True, pass_cols=128)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def test_default_config_fits_and_its_smem_is_counted_region_by_region():
    # four stages of a 128 x 64 x tile and four 64 x 64 w panels, eight warps' 16 staged rows
    # of 64 columns (+16 bytes), 2 x 4 barriers, 1024 bytes of slack
    assert DEFAULT.smem_bytes() == 4 * (2 + 4) * 8192 + 8 * 16 * 144 + 16 * 4 + 1024
    assert DEFAULT.smem_bytes() <= SMEM_LIMIT
    assert DEFAULT.bm == 128 and PINGPONG.bm == 64
    # one more stage, or 128 staged columns, no longer fits beside four stages
    with pytest.raises(PlanError, match="shared memory"):
        check(GemmWsProblem("float16"), GemmWsConfig(stages=5))
    with pytest.raises(PlanError, match="shared memory"):
        check(GemmWsProblem("float16"), GemmWsConfig(pass_cols=128))


@pytest.mark.parametrize(("problem", "config", "match"), [
    (GemmWsProblem("float32"), DEFAULT, "float16 or bfloat16"),
    (GemmWsProblem("float16", "tanh"), DEFAULT, "activation"),
    (GemmWsProblem("float16"), GemmWsConfig(bn=192), "tile width"),
    (GemmWsProblem("float16"), GemmWsConfig(bn=128, pass_cols=256), "tile width"),
    (GemmWsProblem("float16"), GemmWsConfig(stages=1), "stages"),
])
def test_bad_problems_and_configs_are_refused(problem, config, match):
    with pytest.raises(PlanError, match=match):
        render_gemm_ws(problem, config)


def test_names_are_unique_per_source():
    problems = [GemmWsProblem(d, a, b) for d, a, b in
                itertools.product(("float16", "bfloat16"), ACTIVATIONS, (True, False))]
    configs = [DEFAULT, PINGPONG, N128]
    names = {entry_name(p, c) for p in problems for c in configs}
    assert len(names) == len(problems) * len(configs)
    src = render_gemm_ws(GemmWsProblem("bfloat16", "silu", False), N128)
    assert src.entry_points == (src.name,)
    assert "typedef __nv_bfloat16 T;" in src.code and "ACT = 4" in src.code
    assert "COOP = 1, PASS = 128" in src.code and "HAS_BIAS = 0" in src.code


def test_launch_geometry():
    assert gemm_ws_tiles(8192, 3072) == 64 * 12            # 128 x 256 tiles
    assert gemm_ws_tiles(8192, 3072, PINGPONG) == 128 * 12
    assert gemm_ws_tiles(1000, 200) == 8 * 1                 # partial tiles count
    assert gemm_ws_grid(8192, 3072, 132) == 132              # persistent: one block per SM
    assert gemm_ws_grid(130, 136, 132) == 2
    check_shape(1000, 200, 200)
    for m, n, k in ((8, 12, 16), (8, 16, 12), (0, 8, 8)):
        with pytest.raises(PlanError, match="multiples of 8"):
            check_shape(m, n, k)


VARIANTS = ([(GemmWsProblem(d, a, b), DEFAULT) for d in ("float16", "bfloat16")
             for a in ACTIVATIONS for b in (True, False) if b or a == "gelu_erf"]
            + [(GemmWsProblem("float16", "gelu_erf"), c) for c in (PINGPONG, N128)])


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize(("problem", "config"), VARIANTS,
                         ids=[entry_name(p, c) for p, c in VARIANTS])
def test_every_variant_compiles_for_sm90a(problem, config):
    source = render_gemm_ws(problem, config)
    kernel = compile_source(source, TARGET, options=("-lineinfo",))
    assert kernel.binary[:4] == b"\x7fELF"
    assert source.name.encode() in kernel.binary


@pytest.mark.skipif(shutil.which("ptxas") is None and not shutil.os.path.exists(
    "/usr/local/cuda/bin/ptxas"), reason="ptxas (the CUDA toolkit) is not installed")
def test_default_config_does_not_spill(tmp_path):
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    for dtype in ("float16", "bfloat16"):
        source = render_gemm_ws(GemmWsProblem(dtype, "gelu_erf"), DEFAULT)
        ptx = compile_source(source, "compute_90a", options=("-lineinfo",))
        path = tmp_path / f"{dtype}.ptx"
        path.write_bytes(ptx.binary)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o", str(tmp_path / "o")],
                             capture_output=True, text=True, check=True).stderr
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log
        assert "C75" not in log, log   # no serialised wgmma


def test_twin_choice_takes_only_what_the_kernel_wins_and_computes():
    from stofc.kernels.gemm_ws import MAX_K, twin_choice

    base = dict(arch="sm_90", dtype="float16", act="gelu_erf", has_bias=True, has_residual=False,
                fp32_out=False, k=768, n=3072)
    assert twin_choice(**base) == GemmWsProblem("float16", "gelu_erf", True)
    assert twin_choice(**base | {"dtype": "bfloat16", "has_bias": False}) == \
        GemmWsProblem("bfloat16", "gelu_erf", False)
    assert twin_choice(**base | {"k": MAX_K}) is not None
    for change in ({"arch": "sm_80"}, {"arch": "sm_89"}, {"act": "gelu_tanh"}, {"act": "none"},
                   {"has_residual": True}, {"fp32_out": True}, {"k": MAX_K + 8}, {"k": 100},
                   {"k": 56}, {"n": 56},
                   {"n": 3071}, {"dtype": "float32"}):
        assert twin_choice(**base | change) is None, change

