"""Run-time attention variants: the selector's grid rule and tuned buckets reach the package.

The CUDA twin picks the first eligible variant per run (OPS.md); here we check what
the package writes: which kernels, with which eligibility bounds, and that every
file the attributes name exists.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import onnx
import pytest
from onnx import helper

from stofc.kernels.attention import AttentionConfig, AttentionProblem, select_kernel
from stofc.kernels.attention.block import block_config, blocks_per_sm, split_limit
from stofc.lower.attention import attention_kernel
from stofc.masks import encode, parse_mask
from stofc.package.load import read_plan
from stofc.pipeline import Instruments, compile_model, recompile_package
from stofc.plan.plan import KernelSpec
from stofc.targets import get_profile

ROOT = Path(__file__).resolve().parents[2]
H200 = get_profile("h200")
A100 = get_profile("a100")
A10 = get_profile("a10")
BIGBIRD = "bigbird:block=64,window=3,global=2,random=3,seed=0"


def _fmt(spec: str = BIGBIRD, length: int = 2048):
    return encode(parse_mask(spec), length, tile=64, num_heads=12)


@pytest.mark.parametrize("profile", [H200, A10], ids=lambda p: p.name)
def test_split_limit_is_the_selectors_wave_rule(profile):
    fmt = _fmt()
    whole = AttentionConfig("block", 64, 16, 4, 2, 1)
    slots = profile.sm_count * blocks_per_sm(whole, 64, profile)
    limit = split_limit(fmt, profile, heads=12, head_dim=64)
    assert limit == math.ceil(slots / 12) - 1 > 0
    # the limit is exactly where "batch * heads * rows < slots" stops holding
    assert limit * 12 < slots <= (limit + 1) * 12
    for batch_rows in (1, limit, limit + 1, 4 * limit):
        batch = max(1, batch_rows // fmt.tile_rows)
        expect = 2 if batch * fmt.tile_rows * 12 < slots else 1
        assert block_config(fmt, profile, batch=batch, heads=12, head_dim=64).q_split == expect


def _problem(fmt, heads: int, batch: int = 1, *, key_bits: bool = False,
             seq_len: int = 2048) -> AttentionProblem:
    return AttentionProblem(fmt, batch, heads, 64, seq_len, "float16", has_key_bits=key_bits)


def test_block_choice_gets_an_unsplit_base_and_a_split_variant():
    """The query-split variant of block-wise choices (on Hopper the warp-specialised kernel
    is picked instead: it balances short grids by splitting rows into work items)."""
    fmt = _fmt()
    ak = attention_kernel(_problem(fmt, 4, key_bits=True), A100, max_seq_len=2048)
    assert select_kernel(fmt, A100, batch=1, heads=4, seq_len=2048, head_dim=64).config.q_split == 2
    assert ak.choice.config.q_split == 1 and ak.choice.config.warps == 4
    (var,) = ak.variants
    assert var.choice.config.q_split == 2 and var.max_seq_len == 0
    assert var.max_batch_rows == split_limit(fmt, A100, heads=4, head_dim=64)
    base, split = ak.instances()
    assert split.name == ak.instance(var.choice).name != base.name
    assert "_k1" in split.name and "_b0" in split.name      # key bits tested, no bias
    assert ak.choice.config.describe() in ak.choice.explanation
    assert "at run time" in ak.choice.explanation
    # the compile batch no longer changes the package: a big batch gives the same kernels
    big = attention_kernel(_problem(fmt, 4, 64, key_bits=True), A100, max_seq_len=2048)
    assert [k.name for k in big.instances()] == [base.name, split.name]


def test_row_wise_choice_has_no_variants():
    fmt = encode(parse_mask("dilated:window=256,dilation=8"), 1024, tile=16, num_heads=4)
    ak = attention_kernel(_problem(fmt, 4, seq_len=1024), H200, max_seq_len=1024)
    assert ak.choice.kernel == "row" and ak.variants == ()


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    import sys
    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model
    model = tmp_path_factory.mktemp("m") / "model.onnx"
    onnx.save(build_model(layers=2, hidden=128, heads=2, seq=256), str(model))
    return compile_model(model, "bigbird:block=64,window=3,global=1,random=1,seed=0", gpu="h200",
                         max_seq_len=256, out_dir=tmp_path_factory.mktemp("p") / "pkg",
                         instruments=Instruments(progress=False),
                         seq_lens=())   # the split variant alone (buckets: test_selector_buckets)


def test_package_nodes_carry_the_variants_and_their_files(package):
    model = onnx.load(str(package / "model.onnx"))
    doc = json.loads((package / "plan.json").read_text())
    nodes = [n for n in model.graph.node if n.op_type == "SparseAttention"]
    assert len(nodes) == len(doc["attention"]) == 2
    for node, entry in zip(nodes, doc["attention"], strict=True):
        a = _attrs(node)
        kernels = _text(a["variant_kernels"]).split(";")
        plans = _text(a["variant_launch_plans"]).split(";")
        n = len(entry["variants"])
        assert n == 1 and len(kernels) == len(plans) == n
        for key in ("block_threads", "blocks_per_tile_row", "smem_bytes", "max_seq_len",
                    "max_batch_rows"):
            assert len(a[f"variant_{key}"]) == n, key
        var = entry["variants"][0]
        assert a["variant_max_batch_rows"] == [var["max_batch_rows"]]
        assert a["variant_block_threads"] == [var["launch"]["block_threads"]]
        assert a["variant_blocks_per_tile_row"] == [2]
        assert kernels[0].split(":")[1] == var["source"] != entry["source"]
        for rel in (kernels[0].split(":")[0], plans[0], _text(a["launch_plan"])):
            assert (package / rel).is_file(), rel
        assert a["block_threads"] == 128 and a["blocks_per_tile_row"] == 1
    listed = {k["name"] for k in doc["kernels"]}
    assert {e["variants"][0]["source"] for e in doc["attention"]} <= listed


def _plan_with(plan, layer_cfg: dict[int, AttentionConfig]):
    kernels = {}
    for lp in plan.layers:
        cfg = layer_cfg[lp.index]
        kernels[lp.index] = cfg
    layers = []
    for lp in plan.layers:
        segs = tuple(replace(s, kernel=KernelSpec("attention", "attention/block.cu.j2", (
            ("dtype", plan.dtype), *((k, getattr(kernels[lp.index], k)) for k in (
                "kind", "tile", "warp_m", "warps", "stages", "q_split", "gather", "min_blocks",
                "permute"))))) if s.family == "attention" else s for s in lp.segments)
        layers.append(replace(lp, segments=segs))
    return replace(plan, layers=tuple(layers))


def test_tuned_buckets_become_length_variants(package):
    fmt = encode(parse_mask("bigbird:block=64,window=3,global=1,random=1,seed=0"), 256, tile=64,
                 num_heads=2)
    problem = AttentionProblem(fmt, 1, 2, 64, 256, "float16", has_key_bits=True)
    c_small = AttentionConfig("block", 64, 16, 2, 2, 2)
    c_mid = AttentionConfig("block", 64, 16, 4, 3, 1)
    c_big = AttentionConfig("block", 64, 16, 4, 2, 1)
    out = attention_kernel(problem, H200, max_seq_len=256, planned=c_big,
                           buckets=((64, c_small), (128, c_mid), (256, c_big)))
    assert out.choice.config == c_big
    assert [(v.max_seq_len, v.max_batch_rows, v.choice.config) for v in out.variants] == [
        (64, 0, c_small), (128, 0, c_mid)]
    # layer 1: the 128 bucket equals the base, so only the 64 bucket is a variant
    out1 = attention_kernel(problem, H200, layer=1, max_seq_len=256, planned=c_big,
                            buckets=((64, c_small), (128, c_big), (256, c_big)))
    assert [(v.max_seq_len, v.choice.config) for v in out1.variants] == [(64, c_small)]
    # the tuned plan replaces the analytical split variant
    assert all(v.reason.startswith("tuned") for v in out.variants + out1.variants)
    assert len(out.instances()) == 3 and len({k.name for k in out.instances()}) == 3
    # through the package: the plan keeps the base config, the buckets become variants
    plan = read_plan(package)
    p_small = _plan_with(plan, {0: c_small, 1: c_small})
    p_mid = _plan_with(plan, {0: c_mid, 1: c_big})
    p_big = _plan_with(plan, {0: c_big, 1: c_big})
    recompile_package(package, p_big, instruments=Instruments(progress=False),
                      buckets=((64, p_small), (128, p_mid), (256, p_big)))
    doc = json.loads((package / "plan.json").read_text())
    seg = next(s for s in read_plan(package).layers[0].segments if s.family == "attention")
    assert seg.kernel.param("q_split") == 1 and seg.kernel.param("warps") == 4
    assert [v["max_seq_len"] for v in doc["attention"][0]["variants"]] == [64, 128]
    assert [v["max_seq_len"] for v in doc["attention"][1]["variants"]] == [64]
