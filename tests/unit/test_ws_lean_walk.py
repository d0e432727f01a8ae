"""Lean walks of the warp-specialised kernel, without a GPU (``ws_plan.lean_walk``).

A plan whose every walk entry is a full tile of each warpgroup, with no shared chunk,
gets the kernel whose consumers read no walk entries (``AttentionConfig.lean_walk``):
the selector and the tuner set the flag from the plan (for nodes without a bias or key
bits, which compile the lean path out), a lean config on a mask with part
tiles is refused before it can launch, and the source compiles the lean path only
without a bias and key bits. The GPU side is tests/gpu/test_attention_ws.py
(``test_lean_walks``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from stofc.errors import StofcError
from stofc.kernels.attention import AttentionConfig, KernelSpec, select_kernel
from stofc.kernels.attention.config import ExtraInputs
from stofc.kernels.attention.family import AttentionProblem
from stofc.kernels.attention.render import render_kernel
from stofc.kernels.attention.ws import AttentionWs
from stofc.kernels.attention.ws_cost import ws_config
from stofc.kernels.attention.ws_launch import config_plan, with_lean_walk, ws_launch_data
from stofc.kernels.attention.ws_plan import (
    WS_BLOCKS_PER_SM,
    lean_walk,
    lean_walk_applies,
    plan_ws,
)
from stofc.masks import encode
from stofc.targets import get_profile

H200 = get_profile("h200")
BIGBIRD = "bigbird:block=64,window=3,global=2,random=3,seed=0"


def ws(consumers: int, split: int = 0, kstep: int = 1) -> AttentionConfig:
    return AttentionConfig("ws", 64, 16, 4 * (consumers + 1), 4 if kstep == 2 else 2, 1,
                           min_blocks=WS_BLOCKS_PER_SM[consumers], mma="wgmma", split=split,
                           pingpong=consumers > 1, kstep=kstep)


@pytest.mark.parametrize("spec,L,consumers,split,lean", [
    ("dense", 2304, 4, 0, True),
    ("dense", 2304, 3, 8, True),          # split rows: chunks every warpgroup computes
    ("dense", 2048, 3, 0, False),         # the last block's third tile row is past the mask
    (BIGBIRD, 2048, 1, 16, True),         # one consumer: each tile row its own walk
    (BIGBIRD, 2048, 2, 0, False),         # a union of two rows: steps one of them skips
    ("causal", 2048, 1, 0, False),        # diagonal part tiles
    ("longformer:window=256,global=16", 2048, 1, 8, False),
    ("bigbird:block=32,window=3,global=1,random=2,seed=1", 2048, 1, 0, False),   # 32-blocks
])
def test_lean_walk_of_a_plan(spec, L, consumers, split, lean):
    plan = plan_ws(encode(spec, L), split_tiles=split, consumers=consumers)
    assert lean_walk(plan) is lean


def test_a_shared_chunk_is_not_lean():
    """Longformer's global rows past their band are shared chunks (every warpgroup takes
    every C-th entry of one tile row): never lean, even where the walk were full."""
    plan = plan_ws(encode("global:first=64", 4096), split_tiles=8, consumers=2)
    assert (plan.items[..., 4] > 0).any() and not lean_walk(plan)


@pytest.mark.parametrize("spec,B,D,lean", [
    ("dense", 2, 64, True),               # four consumers, ping-pong: the dense pick
    (BIGBIRD, 1, 64, True),               # BERT's (1, 12, 8192): one consumer
    ("causal", 1, 64, False),
    ("longformer:window=256,global=16", 1, 64, False),
    ("dense", 1, 256, False),             # a lean plan, but not at head_dim 256 (LEAN_HEAD_DIMS)
])
def test_the_selector_sets_the_flag_from_its_plan(spec, B, D, lean):
    fmt = encode(spec, 8192)
    cfg = ws_config(fmt, H200, batch=B, heads=12, head_dim=D)
    assert cfg is not None and cfg.lean_walk is lean
    assert lean_walk(config_plan(fmt, cfg)) is (lean or D != 64)
    assert ("lean walk" in cfg.describe()) is lean


def test_a_package_of_bigbird_runs_the_lean_kernel():
    """What ``stofc compile`` asks (select_kernel): BERT's BigBird layer at (1, 12, 8192)
    gets the ws kernel with one consumer and the lean walk, named ``..._f_b0_k0``."""
    fmt = encode(BIGBIRD, 8192)
    choice = select_kernel(fmt, H200, batch=1, heads=12, seq_len=8192, head_dim=64)
    assert choice.kernel == "ws" and choice.config.lean_walk
    assert KernelSpec(choice.config, "float16", 64).name.endswith("_f_b0_k0")


@pytest.mark.parametrize("extras", [ExtraInputs(has_key_bits=True), ExtraInputs(has_bias=True)])
def test_a_node_with_key_bits_or_a_bias_takes_no_lean_walk(extras):
    """Key bits (an encoder's ``attention_mask``) and a bias compile the lean path out of the
    kernel, so neither the selector nor the tuner sets the flag for such a node: a kernel
    named ``_f`` would run the general walk while ``inspect`` said lean."""
    fmt = encode(BIGBIRD, 8192)
    assert not lean_walk_applies(64, extras.has_bias, extras.has_key_bits)
    assert lean_walk_applies(64, False, False) and not lean_walk_applies(128, False, False)
    cfg = ws_config(fmt, H200, batch=1, heads=12, head_dim=64, extras=extras)
    assert cfg is not None and not cfg.lean_walk and "lean walk" not in cfg.describe()
    if extras.has_key_bits:                 # one consumer (a bias spills there: three)
        assert cfg.warps == 8 and lean_walk(config_plan(fmt, cfg))   # the plan itself is lean
    choice = select_kernel(fmt, H200, batch=1, heads=12, seq_len=8192, head_dim=64,
                           extras=extras)
    assert not choice.config.lean_walk
    problem = AttentionProblem(encode(BIGBIRD, 4096), 1, 12, 64, 4096, "float16",
                               has_bias=extras.has_bias, has_key_bits=extras.has_key_bits)
    configs, _ = AttentionWs().candidates(problem, H200)
    assert configs and not any(c.lean_walk for c in configs)


def test_the_tuner_space_sets_the_flag_per_walk():
    """Every candidate of a BigBird problem: one consumer walks lean, unions do not."""
    fmt = encode(BIGBIRD, 4096)
    configs, _ = AttentionWs().candidates(AttentionProblem(fmt, 1, 12, 64, 4096, "float16"), H200)
    by_consumers = {(c.warps // 4 - 1, c.lean_walk) for c in configs}
    assert (1, True) in by_consumers and (1, False) not in by_consumers
    assert {lean for c, lean in by_consumers if c > 1} == {False}
    for c in configs:
        assert c.lean_walk is lean_walk(config_plan(fmt, c))
    dense = encode("dense", 4096)
    wide, _ = AttentionWs().candidates(AttentionProblem(dense, 1, 8, 128, 4096, "bfloat16"), H200)
    assert wide and not any(c.lean_walk for c in wide)        # head_dim 128: the general walk


def test_a_lean_config_is_refused_on_a_walk_with_part_tiles():
    fmt = encode("dense", 2048)
    cfg = with_lean_walk(fmt, ws(4), 64)
    assert cfg.lean_walk
    ws_launch_data(fmt, cfg)                                   # its own mask: launched
    with pytest.raises(StofcError, match="part tiles"):
        ws_launch_data(encode("causal", 2048), cfg)
    ws_launch_data(encode("causal", 2048), replace(cfg, lean_walk=False))     # not lean: runs


@pytest.mark.parametrize("bias,key_bits", [(False, False), (True, False), (False, True)])
def test_the_source_compiles_the_lean_path_only_without_bias_and_key_bits(bias, key_bits):
    cfg = with_lean_walk(encode("dense", 2048), ws(1), 64)
    spec = KernelSpec(cfg, "float16", 64, has_bias=bias, has_key_bits=key_bits)
    src = render_kernel(spec).code
    assert "_f_b" in spec.name and "_f_" not in KernelSpec(replace(cfg, lean_walk=False),
                                                            "float16", 64).name
    assert "constexpr bool LEAN_WALK = true && !HAS_BIAS && !HAS_KEY_BITS;" in src
    assert f"constexpr bool HAS_BIAS = {str(bias).lower()};" in src
    plain = render_kernel(KernelSpec(replace(cfg, lean_walk=False), "float16", 64)).code
    assert "constexpr bool LEAN_WALK = false && !HAS_BIAS && !HAS_KEY_BITS;" in plain
