"""The ``ai.stofc`` ``Rotary`` op's CPU twin in ONNX Runtime against a float64 numpy reference.

``Rotary(q, k?, v?, cos, sin, position_ids?) -> [Q' | K' | V]`` (cuda/ort/OPS.md): every Q
and K head's first ``rotary_dim`` elements rotated (rotate-half or interleaved pairs; full or
half tables), the rest of the head and V copied. Checked against
:func:`stofc.kernels.rotary.rotary_reference` (itself checked here against a direct
per-element formula) for rotate-half, interleaved, partial rotary, grouped-query heads,
packed and separate Q/K/V, float / float16 / bfloat16, tables ``[S, W]``, ``[1, S, W]``,
``[B, S, W]``, and caches read through position ids ``[B, S]``, ``[1, S]`` and an offset
``[1]``; the twin's bound is one rounding of the element type. Bad inputs fail the run with
one line naming the input.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from stofc.kernels.rotary import rotary_reference
from stofc.package.ortlib import build_library

ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
        "bfloat16": TensorProto.BFLOAT16}
# one rounding of the element type, relative to the row's largest value
ULP = {"float32": 2.0 ** -22, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("lib"))


def _session(lib, *, dtype, heads, kv_heads, head_dim, rotary_dim, interleaved, packed,
             table_rank, positions):
    """One Rotary node; the float inputs are Cast to ``dtype`` inside the model."""
    elem = ELEM[dtype]
    names = ["q", "k", "v"] if not packed else ["q", "", ""]
    nodes, inputs = [], []
    for n in names:
        if n:
            nodes.append(helper.make_node("Cast", [n], [f"{n}t"], to=elem))
            inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    ins = [f"{n}t" if n else "" for n in names] + ["cos", "sin"]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin")]
    if positions:
        ins.append("pos")
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, None))
    nodes.append(helper.make_node("Rotary", ins, ["yt"], domain="ai.stofc", num_heads=heads,
                                  kv_num_heads=kv_heads, head_dim=head_dim,
                                  rotary_dim=rotary_dim, interleaved=int(interleaved)))
    nodes.append(helper.make_node("Cast", ["yt"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "rotary", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` as the element type holds it (the op's inputs after the model's Cast)."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return x.astype(np.float32).astype(np.float64)


def _tables(rng, table_rank, positions, batch, seq, width):
    """cos, sin (float32) and position ids for one case."""
    pos = None
    if positions == "ids":
        cache = 3 * seq + 5
        pos = rng.integers(0, cache, (batch, seq)).astype(np.int64)
    elif positions == "ids_shared":
        cache = 2 * seq
        pos = rng.permutation(cache)[:seq].reshape(1, seq).astype(np.int64)
    elif positions == "offset":
        cache = seq + 7
        pos = np.array([7], np.int64)
    angles = rng.uniform(-8.0, 8.0, (cache, width)) if pos is not None else \
        rng.uniform(-8.0, 8.0, {2: (seq, width), 3: (1, seq, width),
                                4: (batch, seq, width)}[table_rank])
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32), pos


CASES = [
    # dtype, H, Hkv, D, rotary_dim, interleaved, packed, table rank (4: [B, S, W]), half, positions
    ("float16", 4, 4, 32, 32, False, True, 2, False, None),      # ModernBERT-like, packed
    ("float16", 4, 2, 32, 32, False, False, 3, False, None),     # Llama GQA, [1, S, W]
    ("bfloat16", 4, 1, 64, 64, False, False, 4, False, None),    # MQA, per-batch tables
    ("bfloat16", 2, 1, 32, 16, False, True, 3, False, None),     # Phi-3: partial, packed GQA
    ("float16", 2, 2, 64, 16, True, False, 2, False, None),      # GPT-J: interleaved, partial
    ("float32", 3, 3, 16, 16, True, True, 3, False, None),
    ("float16", 4, 2, 32, 32, False, False, 2, True, "ids"),     # ORT contrib: half cache + ids
    ("bfloat16", 2, 2, 32, 24, True, True, 2, True, "ids_shared"),
    ("float16", 4, 4, 16, 16, False, True, 2, True, "offset"),
    ("float32", 2, 1, 48, 32, False, False, 2, False, "ids"),    # a full-width cache
    ("float16", 8, 2, 80, 40, False, True, 4, True, None),       # half tables, no ids
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-h{c[1]}/{c[2]}-d{c[3]}r{c[4]}-"
                                             f"{'il' if c[5] else 'rh'}-{'p' if c[6] else 's'}-"
                                             f"t{c[7]}{'h' if c[8] else ''}-{c[9]}"
                                             for c in CASES])
def test_cpu_twin_matches_the_float64_reference(lib, case):
    dtype, h, hkv, d, rd, il, packed, rank, half, positions = case
    rng = np.random.default_rng(sum(map(ord, repr(case))))
    batch, seq = 3, 7
    width = rd // 2 if half else rd
    cos, sin, pos = _tables(rng, rank, positions, batch, seq, width)
    sess = _session(lib, dtype=dtype, heads=h, kv_heads=hkv, head_dim=d, rotary_dim=rd,
                    interleaved=il, packed=packed, table_rank=rank, positions=pos is not None)
    if packed:
        feeds = {"q": rng.standard_normal((batch, seq, (h + 2 * hkv) * d)).astype(np.float32)}
    else:
        feeds = {"q": rng.standard_normal((batch, seq, h * d)).astype(np.float32),
                 "k": rng.standard_normal((batch, seq, hkv * d)).astype(np.float32),
                 "v": rng.standard_normal((batch, seq, hkv * d)).astype(np.float32)}
    feeds |= {"cos": cos, "sin": sin} | ({"pos": pos} if pos is not None else {})
    (got,) = sess.run(None, feeds)
    held = {n: _round(x, dtype) for n, x in feeds.items() if n in ("q", "k", "v")}
    want = rotary_reference(held["q"], held.get("k"), held.get("v"), cos, sin, num_heads=h,
                            kv_heads=hkv, head_dim=d, rotary_dim=rd, interleaved=il,
                            position_ids=pos)
    assert got.shape == want.shape == (batch, seq, (h + 2 * hkv) * d)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2 * ULP[dtype] * scale, dtype
    v_at = (h + hkv) * d                                     # V is copied bit for bit
    assert np.array_equal(got[..., v_at:], want[..., v_at:])
    tail = np.concatenate([np.arange(x * d + rd, (x + 1) * d) for x in range(h + hkv)]) \
        if rd < d else np.array([], int)
    assert np.array_equal(got[..., tail], want[..., tail])   # past rotary_dim: copied


def test_the_reference_is_the_per_element_formula():
    """rotary_reference against the textbook rotation of each pair, element by element."""
    rng = np.random.default_rng(1)
    b, s, h, hkv, d, rd = 2, 5, 2, 1, 12, 8
    q, k, v = (rng.standard_normal((b, s, n * d)) for n in (h, hkv, hkv))
    theta = rng.uniform(-3, 3, (s, rd // 2))
    for il in (False, True):
        cos, sin = np.cos(theta), np.sin(theta)
        got = rotary_reference(q, k, v, cos, sin, num_heads=h, kv_heads=hkv, head_dim=d,
                               rotary_dim=rd, interleaved=il)
        for x, at, heads in ((q, 0, h), (k, h * d, hkv)):
            for bi, si, hi, j in itertools.product(range(b), range(s), range(heads),
                                                   range(rd // 2)):
                lo, hi_ = (2 * j, 2 * j + 1) if il else (j, j + rd // 2)
                x0, x1 = x[bi, si, hi * d + lo], x[bi, si, hi * d + hi_]
                c, sn = cos[si, j], sin[si, j]
                assert got[bi, si, at + hi * d + lo] == pytest.approx(x0 * c - x1 * sn)
                assert got[bi, si, at + hi * d + hi_] == pytest.approx(x1 * c + x0 * sn)
        assert np.array_equal(got[..., (h + hkv) * d:], v)


BAD = [
    (dict(q=(2, 3, 100)), "input q has shape [2, 3, 100], expected [B, S, 256]"),
    (dict(cos=(3, 10), sin=(3, 10)),
     "input cos has shape [3, 10]: its last dimension must be rotary_dim=32"),
    (dict(cos=(4, 32), sin=(4, 32)), "expected [S, W] or [1 or B, S, W] with S=3"),
    (dict(cos=(2, 4, 3, 32), sin=(2, 4, 3, 32)), "expected [S, W] or [1 or B, S, W]"),
    (dict(sin=(1, 3, 32)), "inputs cos [3, 32] and sin [1, 3, 32] must have one shape"),
]


@pytest.mark.parametrize("shapes,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_inputs_fail_the_run_naming_the_input(lib, shapes, message):
    sess = _session(lib, dtype="float16", heads=4, kv_heads=2, head_dim=32, rotary_dim=32,
                    interleaved=False, packed=True, table_rank=2, positions=False)
    want = {"q": (2, 3, 256), "cos": (3, 32), "sin": (3, 32)} | shapes
    feeds = {n: np.zeros(s, np.float32) for n, s in want.items()}
    with pytest.raises(Exception, match=re.escape(message)) as err:
        sess.run(None, feeds)
    assert "stofc Rotary: input" in str(err.value)


def test_positions_outside_the_cache_fail_the_run(lib):
    sess = _session(lib, dtype="float16", heads=2, kv_heads=2, head_dim=16, rotary_dim=16,
                    interleaved=False, packed=True, table_rank=2, positions=True)
    feeds = {"q": np.zeros((1, 4, 96), np.float32), "cos": np.zeros((5, 8), np.float32),
             "sin": np.zeros((5, 8), np.float32), "pos": np.array([2], np.int64)}
    with pytest.raises(Exception, match=r"position 5 of token \(0, 3\) is outside the 5-row"):
        sess.run(None, feeds)
    feeds["pos"] = np.array([[0, 1, 2, 3], [0, 1, 2, 3]], np.int64)   # B = 1: [2, S] is not
    with pytest.raises(Exception, match=r"position_ids has shape \[2, 4\], expected \[1\]"):
        sess.run(None, feeds)


def test_attributes_are_checked_at_session_creation(lib):
    with pytest.raises(Exception, match=r"attribute rotary_dim=12 must be even and in 2\.\.8"):
        _session(lib, dtype="float16", heads=2, kv_heads=2, head_dim=8, rotary_dim=12,
                 interleaved=False, packed=True, table_rank=2, positions=False)
