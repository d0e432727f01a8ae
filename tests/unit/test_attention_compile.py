"""CI without a GPU: the attention templates render and compile with NVRTC for every arch.

A representative set covers every template flag and every value the search
space can give a template parameter: both kernels, fp16 and bf16, every
head_dim, bias and key bits on/off, every tile / rows-per-warp / warps /
stages / query split. Compiled once per arch (content-addressed cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stofc.errors import CompileError, StofcError
from stofc.kernels.attention import AttentionConfig, KernelSpec, render_kernel, search_space
from stofc.kernels.attention.config import HEAD_DIMS
from stofc.kernels.attention.render import compile_kernel
from stofc.targets import get_profile

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


def representative_specs() -> list[KernelSpec]:
    """Every template flag and parameter value at least once, per the search spaces."""
    profile = get_profile("h100")
    specs: dict[str, KernelSpec] = {}

    def add(spec: KernelSpec) -> None:
        specs.setdefault(spec.name, spec)

    base = {"block": AttentionConfig("block", 64, 16, 4, 2, 1),
            "row": AttentionConfig("row", 64, 1, 4)}
    for kind, cfg in base.items():
        for dtype in ("float16", "bfloat16"):
            for d in HEAD_DIMS:
                add(KernelSpec(cfg, dtype, d))
            add(KernelSpec(cfg, dtype, 64, has_bias=True, has_key_bits=True))
            add(KernelSpec(cfg, dtype, 256, has_softcap=True, has_key_bits=True))
        add(KernelSpec(cfg, "float16", 64, has_bias=True))
        add(KernelSpec(cfg, "float16", 64, has_key_bits=True))
        add(KernelSpec(cfg, "float16", 128, has_softcap=True, has_bias=True))
        seen: set[tuple] = set()
        for tile in (64, 128):
            for c in search_space(kind, 64, "float16", profile, tile=tile):
                # one spec per distinct template-parameter value (gather is runtime data)
                for key in (("tile", c.tile), ("warp_m", c.warp_m), ("warps", c.warps),
                            ("stages", c.stages), ("q_split", c.q_split), ("tw", c.tile, c.warps),
                            ("min_blocks", c.min_blocks)):
                    if key not in seen:
                        seen.add(key)
                        add(KernelSpec(c, "float16", 64))
    return sorted(specs.values(), key=lambda s: s.name)


SPECS = representative_specs()


def test_representative_set_covers_the_search_space():
    profile = get_profile("h100")
    names = {s.name for s in SPECS}
    assert len(names) == len(SPECS)
    for kind in ("block", "row"):
        for tile in (64, 128):
            for c in search_space(kind, 64, "float16", profile, tile=tile):
                values = {(s.config.kind, "tile", s.config.tile) for s in SPECS} | \
                    {(s.config.kind, "warp_m", s.config.warp_m) for s in SPECS} | \
                    {(s.config.kind, "stages", s.config.stages) for s in SPECS} | \
                    {(s.config.kind, "q_split", s.config.q_split) for s in SPECS} | \
                    {(s.config.kind, "warps", s.config.warps) for s in SPECS}
                for key in (("tile", c.tile), ("warp_m", c.warp_m), ("stages", c.stages),
                            ("q_split", c.q_split), ("warps", c.warps)):
                    assert (kind, *key) in values
    flags = {(s.config.kind, s.dtype, s.head_dim, s.has_bias, s.has_key_bits) for s in SPECS}
    for kind in ("block", "row"):
        for dtype in ("float16", "bfloat16"):
            assert all((kind, dtype, d, False, False) in flags for d in HEAD_DIMS)
            assert (kind, dtype, 64, True, True) in flags


def _arch_specs(arch: str) -> list[KernelSpec]:
    """sm_80 and sm_90 (the two codegen families) get the whole set; sm_86 and sm_89,
    which share sm_80's instruction set, get every flag of both kernels (time budget)."""
    if arch in ("sm_80", "sm_90"):
        return SPECS
    return [s for s in SPECS if s.head_dim == 64 and s.has_bias and s.has_key_bits]


@pytest.mark.slow  # NVRTC compiles of every variant (still run by make test)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_representative_variant_compiles(arch):
    specs = _arch_specs(arch)
    assert {s.config.kind for s in specs} == {"block", "row"}
    for spec in specs:
        kernel = compile_kernel(spec, arch)
        assert kernel.binary[:4] == b"\x7fELF", spec.name
        assert spec.name in kernel.entry_points


def test_rendered_source_is_logic_free_substitution():
    spec = KernelSpec(AttentionConfig("block", 128, 32, 4, 3, 1), "bfloat16", 96, True, False)
    code = render_kernel(spec).code
    assert f"{spec.name}(" in code
    assert "typedef __nv_bfloat16 T;" in code
    assert "constexpr int D = 96;" in code and "constexpr int STAGES = 3;" in code
    assert "constexpr bool HAS_BIAS = true;" in code and "HAS_KEY_BITS = false;" in code
    assert "{{" not in code and "{%" not in code


def test_compile_error_shows_log_and_dump(tmp_path, monkeypatch):
    from stofc.codegen import Source
    from stofc.compile import compile_source

    monkeypatch.setenv("STOFC_DUMP_DIR", str(tmp_path))
    good = render_kernel(KernelSpec(AttentionConfig("row", 64, 1, 4), "float16", 64))
    bad = Source(good.name + "_broken", good.code.replace("warp_max(s)", "warp_maxx(s)"),
                 good.template, good.entry_points)
    with pytest.raises(CompileError) as info:
        compile_source(bad, "sm_90", use_cache=False)
    assert "warp_maxx" in info.value.log
    assert info.value.source_path
    assert "warp_maxx" in Path(info.value.source_path).read_text()


@pytest.mark.parametrize("head_dim", [16, 48, 100, 512])
def test_unsupported_head_dim_is_a_user_error(head_dim):
    with pytest.raises(StofcError, match="head_dim"):
        render_kernel(KernelSpec(AttentionConfig("row", 64, 1, 4), "float16", head_dim))
    with pytest.raises(StofcError, match="head_dim"):
        search_space("block", head_dim, "float16", get_profile("h100"))


def test_unsupported_dtype_is_a_user_error():
    with pytest.raises(StofcError, match="dtype"):
        render_kernel(KernelSpec(AttentionConfig("row", 64, 1, 4), "float32", 64))
