"""Untuned packages choose attention kernels per sequence-length bucket (issue 18, part 4).

The selector runs on the mask encoded at every bucket length below ``max_seq_len``;
its picks become the node's run-time variants for ``S <= bucket`` (the tuned buckets'
mechanism: ``variant_max_seq_len``), plan.json records every bucket's pick, and the
CUDA twin (against the recording fake driver) launches the pick of the run's length.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from stofc.errors import PlanError
from stofc.kernels.attention import AttentionConfig, AttentionProblem, choose_attention
from stofc.lower.attention import DEFAULT_BUCKETS, attention_kernel, bucket_lengths
from stofc.masks import encode
from stofc.pipeline import Instruments, compile_model
from stofc.targets import get_profile
from tests.unit.test_ortlib_fake_gpu import run

ROOT = Path(__file__).resolve().parents[2]
H100 = get_profile("h100")
MASK = "sliding:window=256"   # picks that change with the length (H100 model, 2026-11-26)
L_MAX, HEADS, D = 8192, 4, 64


def _problem(fmt) -> AttentionProblem:
    return AttentionProblem(fmt, 1, HEADS, D, L_MAX, "float16", has_key_bits=True)


@pytest.fixture(scope="module")
def formats():
    return {n: encode(MASK, n, num_heads=HEADS) for n in (128, 512, 2048, L_MAX)}


def test_bucket_lengths_defaults_and_bounds():
    assert bucket_lengths(None, 8192) == (128, 512, 2048)
    assert bucket_lengths(None, 100) == ()
    assert bucket_lengths(None, 10**6) == DEFAULT_BUCKETS
    assert bucket_lengths((2048, 512, 512, 8192), 8192) == (512, 2048)  # L_max is the base's
    assert bucket_lengths((), 8192) == ()
    with pytest.raises(PlanError, match=r"--seq-len 9000 is outside 1\.\.8192"):
        bucket_lengths((512, 9000), 8192)


def test_each_bucket_gets_the_selectors_pick_at_its_length(formats):
    ak = attention_kernel(_problem(formats[L_MAX]), H100, max_seq_len=L_MAX,
                          length_formats=tuple((n, formats[n]) for n in (128, 512, 2048)))
    assert [b.seq_len for b in ak.buckets] == [128, 512, 2048]
    for b in ak.buckets:       # exactly the selector's pick on the mask encoded at that length
        want, _ = choose_attention(formats[b.seq_len], H100, batch=1, heads=HEADS,
                                   seq_len=b.seq_len, head_dim=D)
        assert b.choice.config == want.config and b.choice.estimates == want.estimates
    base, _ = choose_attention(formats[L_MAX], H100, batch=1, heads=HEADS, seq_len=L_MAX,
                               head_dim=D)
    assert ak.choice.config == base.config
    picks = {b.seq_len: b.choice.kernel for b in ak.buckets}
    # the estimates differ with the length, and so do the picks (H100, 4 heads: ws at 8192
    # measured 27.7 us against block-wise's 31.2, selector-ab-d64-2-h100-2026-11-26)
    assert picks[2048] == "ws" and ak.choice.kernel == "ws" and picks[128] == "block"
    assert ak.buckets[0].choice.estimates != ak.buckets[2].choice.estimates
    # 512 and 2048 pick two consumer warpgroups with turns, the base four without (since
    # 2026-11-27; B=1 H=4 +-256 at 8K: 25.4 us against two's 28.5,
    # ws-variants-d64-consumers-pingpong-h100-2026-11-27.jsonl): the 2048 bucket launches
    # its own variant, which 512 shares
    assert [b.launched for b in ak.buckets] == [True, False, True]
    bounds = [(v.max_seq_len, v.choice.kernel) for v in ak.variants]
    assert bounds == [(128, "block"), (128, "block"), (2048, "ws")]   # 128's split, 128, 2048
    assert ak.variants[2].choice.config != ak.choice.config
    assert "query split" in ak.variants[0].reason
    assert all("selector at S <= " in v.reason for v in ak.variants)


def test_a_planned_config_ignores_the_selector_buckets(formats):
    planned = AttentionConfig("block", 64, 16, 4, 2, 1)
    ak = attention_kernel(_problem(formats[L_MAX]), H100, max_seq_len=L_MAX, planned=planned,
                          length_formats=((2048, formats[2048]),))
    assert ak.buckets == () and ak.choice.config == planned


def test_no_buckets_keeps_the_single_length_choice(formats):
    ak = attention_kernel(_problem(formats[L_MAX]), H100, max_seq_len=L_MAX)
    assert ak.buckets == () and all(v.max_seq_len == 0 for v in ak.variants)


def _eligible(variants, B: int, S: int, tile: int = 64) -> str | None:
    """The CUDA twin's rule (OPS.md): the first variant with S and B*ceil(S/T) in bounds."""
    for v in variants:
        if (v["max_seq_len"] == 0 or v["max_seq_len"] >= S) and \
                (v["max_batch_rows"] == 0 or B * -(-S // tile) <= v["max_batch_rows"]):
            return v["source"]
    return None


@pytest.mark.slow  # a whole package at L_max 8192 (NVRTC + launch plans)
def test_package_for_8192_launches_the_bucket_pick_of_the_run_length(fake, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model

    root = tmp_path_factory.mktemp("buckets")
    model = root / "model.onnx"
    onnx.save(build_model(layers=1, hidden=HEADS * D, heads=HEADS, seq=L_MAX), str(model))
    pkg = compile_model(model, MASK, gpu="h100", max_seq_len=L_MAX, out_dir=root / "pkg",
                        instruments=Instruments(progress=False))
    (entry,) = json.loads((pkg / "plan.json").read_text())["attention"]
    assert [(b["seq_len"], b["kernel"], b["launched"]) for b in entry["buckets"]] == \
        [(128, "block", True), (512, "ws", False), (2048, "ws", True)]
    assert all(set(b["estimate_us"]) >= {"block", "row", "ws"} for b in entry["buckets"])
    node = next(n for n in onnx.load(str(pkg / "model.onnx")).graph.node
                if n.op_type == "SparseAttention")
    attrs = {a.name: a for a in node.attribute}
    assert list(attrs["variant_max_seq_len"].ints) == [v["max_seq_len"]
                                                       for v in entry["variants"]]

    work = root / "run"
    shutil.copytree(pkg, work)
    rng = np.random.default_rng(0)
    shapes = [(1, 100), (1, 1000), (1, L_MAX), (2, 2000)]
    feeds = [{"input_ids": rng.integers(0, 1000, (B, S)).astype(np.int64),
              "attention_mask": np.ones((B, S), np.int64)} for B, S in shapes]
    code, out, records = run(fake, work, onnx.load(str(work / "model.onnx")), feeds)
    assert code == 0, out
    starts = [i for i, r in enumerate(records) if r["call"] == "run"] + [len(records)]
    launched = []
    for i, (B, S) in enumerate(shapes):
        recs = records[starts[i]:starts[i + 1]]
        attn = [r["fn"] for r in recs if r["call"] == "launch"
                and r["fn"].startswith("stofc_attn_") and not r["fn"].endswith("_combine")]
        assert len(attn) == 1, attn
        want = _eligible(entry["variants"], B, S) or entry["source"]
        assert attn[0] == want, (B, S)
        launched.append(attn[0])
    kinds = [name.split("_")[2] for name in launched]
    assert kinds == ["block", "ws", "ws", "ws"]             # 100: block, 1000/2000/8192: ws
    assert launched[1] == launched[3] != launched[2]        # 1000 and 2000: the 2048 bucket's
    # 2048: one consumer, three blocks an SM (o3); 8192: four consumers
    assert "_w8_" in launched[1] and "_o3_" in launched[1] and "_w20_" in launched[2]
