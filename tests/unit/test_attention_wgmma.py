"""The Hopper wgmma block-wise kernel without a GPU: where it is valid, what it is
named and compiled for, that the selector and search spaces offer it on sm_90 only,
that every template variant compiles for sm_90a, and that a package records it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx
import pytest

from stofc.kernels.attention import AttentionConfig, KernelSpec, render_kernel, search_space
from stofc.kernels.attention.block import block_config, kernel_target
from stofc.kernels.attention.config import prune, smem_bytes, template_name
from stofc.kernels.attention.render import compile_kernel
from stofc.masks import encode
from stofc.targets import get_profile

ROOT = Path(__file__).resolve().parents[2]
WG = AttentionConfig("block", 64, 16, 4, 2, 1, mma="wgmma")
H100, A100 = get_profile("h100"), get_profile("a100")


def test_prune_says_where_wgmma_cannot_run():
    assert prune(WG, 64, H100) is None
    assert prune(WG, 128, H100) is None
    assert "Hopper-only" in prune(WG, 64, A100)
    assert "head_dim" in prune(WG, 96, H100)
    split = AttentionConfig("block", 64, 16, 2, 2, 2, mma="wgmma")     # 32 rows per block
    assert "warpgroup" in prune(split, 64, H100)
    assert "warpgroup" in prune(AttentionConfig("block", 64, 32, 2, 2, 1, mma="wgmma"), 64, H100)
    assert prune(AttentionConfig("block", 128, 16, 4, 2, 2, mma="wgmma"), 64, H100) is None
    assert "wgmma" in prune(AttentionConfig("row", 64, 1, 4, mma="wgmma"), 64, H100)
    assert "unknown MMA" in prune(AttentionConfig("block", 64, 16, 4, 2, 1, mma="hmma"), 64, H100)


def test_name_template_target_and_smem():
    spec = KernelSpec(WG, "float16", 64, has_key_bits=True)
    sync = KernelSpec(AttentionConfig("block", 64, 16, 4, 2, 1), "float16", 64, has_key_bits=True)
    # mma.sync names are unchanged; the ORT library reads kind, dtype and the _b?_k? tail
    assert spec.name == sync.name.replace("_b0_k1", "_wg_b0_k1")
    assert spec.name.startswith("stofc_attn_block_f16_") and spec.name.endswith("_b0_k1")
    assert spec.template == template_name("block", "wgmma") == "attention/block_wgmma.cu.j2"
    assert sync.template == "attention/block.cu.j2"
    assert kernel_target("wgmma", "sm_90") == "sm_90a"
    assert kernel_target("wgmma", "compute_90") == "compute_90a"
    assert kernel_target("sync", "sm_90") == "sm_90" and kernel_target("wgmma", "sm_80") == "sm_80"
    # unpadded 128-byte rows plus 1024 bytes of alignment slack
    assert smem_bytes(WG, 64) == 64 * 128 + 2 * (2 * 64 * 128 + 64 * 8 + 64 * 4) + 1024
    assert smem_bytes(WG, 64) < smem_bytes(AttentionConfig("block", 64, 16, 4, 2, 1), 64) + 1024


def test_search_space_and_selector_offer_wgmma_on_hopper_only():
    for tile in (64, 128):
        on_h100 = search_space("block", 64, "float16", H100, tile=tile)
        assert any(c.mma == "wgmma" for c in on_h100)
        assert all(prune(c, 64, H100) is None for c in on_h100)
        assert not any(c.mma == "wgmma" for c in search_space("block", 64, "float16", A100,
                                                               tile=tile))
    assert not any(c.mma == "wgmma" for c in search_space("block", 96, "float16", H100))
    fmt = encode("bigbird:block=64,window=3,global=2,random=3,seed=0", 2048)
    assert block_config(fmt, H100, batch=4, heads=12, head_dim=64).mma == "wgmma"
    assert block_config(fmt, H100, batch=4, heads=12, head_dim=96).mma == "sync"
    assert block_config(fmt, A100, batch=4, heads=12, head_dim=64).mma == "sync"
    # the T=64 query split has 32-row blocks: it stays on mma.sync
    assert block_config(fmt, H100, batch=1, heads=12, head_dim=64, q_split=2).mma == "sync"


def test_rendered_source_substitutes_only():
    code = render_kernel(KernelSpec(AttentionConfig("block", 128, 16, 8, 3, 1, mma="wgmma"),
                                    "bfloat16", 128, True, False)).code
    assert "typedef __nv_bfloat16 T;" in code and "constexpr int D = 128;" in code
    assert "constexpr int STAGES = 3;" in code and "constexpr int WARPS = 8;" in code
    assert "#include <stofc/wgmma.cuh>" in code
    assert "{{" not in code and "{%" not in code


def _wgmma_specs() -> list[KernelSpec]:
    configs = [WG, AttentionConfig("block", 64, 16, 4, 3, 1, min_blocks=4, mma="wgmma"),
               AttentionConfig("block", 128, 16, 8, 2, 1, mma="wgmma"),
               AttentionConfig("block", 128, 16, 4, 4, 2, mma="wgmma")]
    specs = [KernelSpec(c, dt, d, flags, flags) for c in configs[:1]
             for dt in ("float16", "bfloat16") for d in (64, 128) for flags in (False, True)]
    specs += [KernelSpec(c, "float16", d, True, True) for c in configs[1:] for d in (64, 128)]
    specs += [KernelSpec(configs[0], dt, 256, True, True, has_softcap=True)
              for dt in ("float16", "bfloat16")]
    return specs


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("spec", _wgmma_specs(), ids=lambda s: s.name)
def test_every_wgmma_variant_compiles_for_sm_90a(spec):
    kernel = compile_kernel(spec, "sm_90")
    assert kernel.target == "sm_90a"
    assert kernel.binary[:4] == b"\x7fELF" and spec.name in kernel.entry_points


def test_hopper_package_carries_the_wgmma_kernel(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model

    from stofc.pipeline import Instruments, compile_model

    model = tmp_path / "model.onnx"
    onnx.save(build_model(layers=1, hidden=256, heads=4, seq=256), str(model))  # head_dim 64
    pkg = compile_model(model, "causal", gpu="h100", max_seq_len=256, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    doc = json.loads((pkg / "plan.json").read_text())
    attention = [k for k in doc["kernels"] if k["template"] == "attention/block_wgmma.cu.j2"]
    assert attention, [k["template"] for k in doc["kernels"]]
    for entry in attention:
        assert entry["nvrtc_targets"] == {"sm_90": "sm_90a", "compute_90": "compute_90a"}
        assert (pkg / entry["files"]["sm_90"]).read_bytes()[:4] == b"\x7fELF"
    # FusedGemm's one-pass Hopper GEMM (the erf-GELU FFN GEMM's long runs) is wgmma too
    hopper_gemm = [k for k in doc["kernels"] if k["template"] == "gemm/gemm_ws.cu.j2"]
    assert [k["nvrtc_targets"] for k in hopper_gemm] == [{"sm_90": "sm_90a",
                                                          "compute_90": "compute_90a"}]
    others = [k for k in doc["kernels"] if k not in attention and k not in hopper_gemm]
    assert others and all(k["nvrtc_targets"] == SAME for k in others)


SAME = {"sm_90": "sm_90", "compute_90": "compute_90"}
