"""Every template rendered for representative specs, against ``tests/goldens/templates``.

A template change shows up as a reviewed diff of these files; regenerate them with
``STOFC_REGEN_GOLDENS=1 pytest tests/unit/test_render_goldens.py``. The specs cover
each template's switches: GEMM output layouts, epilogues (bias, activations,
residual, LayerNorm / RMSNorm, the pre-norm store), dtypes, the gated FFN's activation
pass (with and without its bias) and its GEMM (the product in registers), the rotary kernel
(rotate-half, partial, interleaved, vector widths), GEMM+GEMM's direct and
workspace modes, Add+Norm's float32 inputs and parameters, the embedding kernel (summands,
beta, float32 parameters, warps per row), and the attention
kernels' tiles, query split, pipeline depth, occupancy bound, wgmma, soft-capping, head_dim
256 (Q re-read from shared memory) and inputs, and the warp-specialised kernel's stages,
ping-pong, split, two-tile steps and three consumer warpgroups.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stofc.codegen import Source
from stofc.kernels import embed_norm as embed_family
from stofc.kernels import gemm as gemm_family
from stofc.kernels import gemm_gemm as gg_family
from stofc.kernels import gemm_ws as gemm_ws_family
from stofc.kernels import glu as glu_family
from stofc.kernels import norm as norm_family
from stofc.kernels import rotary as rotary_family
from stofc.kernels.attention import AttentionConfig, KernelSpec, render_kernel
from stofc.kernels.epilogue import Epilogue
from stofc.paths import templates_dir

GOLDENS = Path(__file__).resolve().parents[1] / "goldens" / "templates"
REGEN = bool(os.environ.get("STOFC_REGEN_GOLDENS"))


def _gemm() -> list[Source]:
    G, C = gemm_family.GemmProblem, gemm_family.GemmConfig
    return [
        gemm_family.render_gemm(G(4096, 3072, 768, "float16", Epilogue(bias=True, act="gelu_erf")),
                                C(128, 128, 32, 2, 4, 3)),
        gemm_family.render_gemm(G(512, 2304, 768, "bfloat16", Epilogue(bias=True), "heads"),
                                C(64, 128, 64, 2, 2, 4)),
        gemm_family.render_gemm(
            G(256, 768, 768, "float16", Epilogue(bias=True, residual=True, norm="layernorm",
                                                 store_pre_norm=True)), C(32, 768, 32, 2, 8, 3)),
        gemm_family.render_gemm(
            G(256, 512, 512, "bfloat16", Epilogue(residual=True, act="relu", norm="rmsnorm",
                                                  norm_shift=False)), C(16, 512, 32, 1, 4, 2)),
    ]


def _gemm_gemm() -> list[Source]:
    P, C = gg_family.GemmGemmProblem, gg_family.GemmGemmConfig
    ffn = (Epilogue(bias=True, act="gelu_erf"), Epilogue(bias=True, residual=True))
    return [
        gg_family.render_gemm_gemm(P(64, 768, 3072, 768, "float16", *ffn), C(16, 64, 32, 4, 3)),
        gg_family.render_gemm_gemm(
            P(64, 256, 1024, 256, "bfloat16", Epilogue(bias=True, act="relu"),
              Epilogue(bias=True, residual=True, norm="layernorm")), C(32, 64, 64, 8, 2, 4)),
    ]


def _norm() -> list[Source]:
    P, C = norm_family.NormProblem, norm_family.NormConfig
    return [
        norm_family.render_norm(P(4096, 768, "float16", Epilogue(residual=True, norm="layernorm",
                                                                store_pre_norm=True)),
                                C(32, 4)),
        norm_family.render_norm(P(4096, 3072, "float16", Epilogue(bias=True, act="gelu_tanh")),
                                C(128, 1)),
        norm_family.render_norm(P(4096, 1024, "bfloat16", Epilogue(residual=True, norm="rmsnorm"),
                                  input_fp32=True, params_fp32=True), C(64, 2)),
        norm_family.render_norm(P(4096, 128, "bfloat16", Epilogue(norm="layernorm",
                                                                 norm_shift=False),
                                  input_fp32=True), C(32, 8)),
    ]


def _embed_norm() -> list[Source]:
    """The EmbedLayerNorm op's kernel: BERT-base's three summands with beta, two summands
    without beta and float32 gamma (bf16), one summand over several warps per row."""
    P, C = embed_family.EmbedNormProblem, embed_family.EmbedNormConfig
    return [
        embed_family.render_embed_norm(P("float16", 768, 3, True), C(32, 4)),
        embed_family.render_embed_norm(P("bfloat16", 1024, 2, False, params_fp32=True), C(64, 2)),
        embed_family.render_embed_norm(P("float16", 4096, 1, True), C(128, 1)),
    ]


def _gemm_ws() -> list[Source]:
    """The Hopper GEMM: the default cooperative config with the erf GELU and a bias (fp16,
    what sm_90 packages build), ping-pong without a bias (bf16, SiLU)."""
    P, C = gemm_ws_family.GemmWsProblem, gemm_ws_family.GemmWsConfig
    return [
        gemm_ws_family.render_gemm_ws(P("float16", "gelu_erf", True)),
        gemm_ws_family.render_gemm_ws(P("bfloat16", "silu", False),
                                      C(bn=256, stages=4, coop=False, pass_cols=128)),
    ]


def _glu() -> list[Source]:
    """The gated FFN's kernels: the gated-activation pass (cuBLASLt's, no bias: the CUDA
    twin; plain cuBLAS's, with it) and the mma.sync GEMM with the product in registers."""
    G, C = glu_family.GatedProblem, glu_family.GatedConfig
    P, GC = glu_family.GluProblem, gemm_family.GemmConfig
    return [
        glu_family.render_gated(G(4096, 11008, "float16", "silu", False), C(256, 1)),
        glu_family.render_gated(G(4096, 768, "bfloat16", "gelu_erf", True), C(32, 4)),
        glu_family.render_gemm_glu(P(4096, 1408, 512, "bfloat16", Epilogue(act="silu")),
                                   GC(128, 128, 32, 2, 4, 3)),
        glu_family.render_gemm_glu(P(256, 768, 768, "float16",
                                     Epilogue(bias=True, act="gelu_tanh")),
                                   GC(64, 64, 64, 2, 2, 4)),
    ]


def _rotary() -> list[Source]:
    """The Rotary op's kernel: rotate-half (full head, partial), interleaved, both dtypes,
    the vector widths (8, 4, 2)."""
    P, C = rotary_family.RotaryProblem, rotary_family.RotaryConfig
    return [
        rotary_family.render_rotary(P("float16", 128, 128, False), C(128)),
        rotary_family.render_rotary(P("bfloat16", 96, 32, False), C(256)),
        rotary_family.render_rotary(P("float16", 64, 64, True), C(128)),
        rotary_family.render_rotary(P("bfloat16", 80, 20, True), C(64)),
        rotary_family.render_rotary(P("float16", 36, 4, False), C(64)),
    ]


def _attention() -> list[Source]:
    A, S = AttentionConfig, KernelSpec
    specs = [
        S(A("block", 64, 16, 4, 2), "float16", 64),
        S(A("block", 64, 16, 2, 3, 2, gather=True, min_blocks=2, permute=True), "bfloat16", 128,
          has_bias=True),
        S(A("block", 128, 32, 4, 2, min_blocks=1), "float16", 32, has_key_bits=True),
        S(A("block", 64, 16, 4, 2, mma="wgmma", min_blocks=4), "float16", 64),
        S(A("block", 128, 16, 8, 2, mma="wgmma"), "bfloat16", 128, True, True),
        S(A("row", 64, 1, 4), "float16", 32),
        S(A("row", 64, 2, 8), "bfloat16", 80, True, True),
        S(A("row", 16, 4, 4), "float16", 96, has_key_bits=True),
        S(A("block", 64, 16, 4, 2), "float16", 256, has_key_bits=True, has_softcap=True),
        S(A("block", 64, 16, 4, 2, mma="wgmma"), "bfloat16", 256, has_softcap=True),
        S(A("row", 64, 1, 4), "float16", 256, has_softcap=True),
        S(A("ws", 64, 16, 12, 2, mma="wgmma"), "float16", 128, has_key_bits=True),
        S(A("ws", 64, 16, 12, 4, mma="wgmma", split=16, pingpong=False, kstep=2), "bfloat16",
          64, has_bias=True, has_softcap=True),
        S(A("ws", 64, 16, 16, 3, mma="wgmma", split=8), "float16", 64, has_key_bits=True),
    ]
    return [render_kernel(s) for s in specs]


SOURCES = {src.name: src for src in (*_gemm(), *_gemm_gemm(), *_glu(), *_norm(), *_embed_norm(),
                                     *_gemm_ws(),
                                     *_rotary(), *_attention())}


def test_every_template_is_covered():
    templates = {p.relative_to(templates_dir()).as_posix()
                 for p in templates_dir().rglob("*.cu.j2")}
    assert templates == {s.template for s in SOURCES.values()}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_render_matches_golden(name):
    src = SOURCES[name]
    path = GOLDENS / src.template.removesuffix(".cu.j2") / f"{name}.cu"
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src.code)
    assert path.is_file(), f"no golden for {name}: run with STOFC_REGEN_GOLDENS=1"
    assert src.code == path.read_text(), f"{name} differs from {path}"
