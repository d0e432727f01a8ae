"""Segment runner pieces that need no GPU: bf16 bit conversion and input checks."""

from __future__ import annotations

import numpy as np
import pytest

from stofc.plan.build import plan_layer
from stofc.plan.moves import initial_scheme
from stofc.plan.synthetic import bert_layer
from stofc.runtime.segment_cublas import lt_split
from stofc.runtime.segments import SegmentInputError, SegmentRunner, from_bits, to_bits
from stofc.targets import get_profile


def test_bf16_bits_round_to_nearest_even():
    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0, -0.0], dtype=np.float32)
    back = from_bits(to_bits(x, "bfloat16"), "bfloat16")
    assert back.dtype == np.float32
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-8)
    # 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1.0)
    assert from_bits(to_bits(np.float32(1 + 2**-8), "bfloat16"), "bfloat16") == 1.0
    assert from_bits(to_bits(np.float32(1 + 3 * 2**-8), "bfloat16"), "bfloat16") == 1 + 2**-6
    h = to_bits(x, "float16")
    assert h.dtype == np.float16
    assert np.array_equal(from_bits(h, "float16"), x.astype(np.float16).astype(np.float32))


def test_lt_epilogue_split_respects_operation_order():
    # cuBLASLt computes act(AB + C + bias): the residual (C) folds only without an activation
    assert lt_split(True, "none", True) == (4, True)      # BIAS, residual as C
    assert lt_split(True, "relu", False) == (6, True)     # RELU_BIAS
    assert lt_split(True, "relu", True) == (4, False)     # relu then residual: kernel does both
    assert lt_split(True, "gelu_erf", False) == (4, False)     # erf GELU: never Lt's tanh form
    assert lt_split(True, "gelu_tanh", False) == (36, True)    # GELU_BIAS (the tanh formula)
    assert lt_split(False, "gelu_tanh", False) == (32, True)   # GELU
    assert lt_split(True, "gelu_tanh", True) == (4, False)     # gelu then residual: kernel
    assert lt_split(False, "none", False) == (1, True)    # DEFAULT


def _bare_runner():
    """A runner object with just what the input checks read (no GPU, no kernels)."""
    layer = bert_layer()
    plan = plan_layer(layer, initial_scheme(layer, tokens=4096), tokens=4096,
                      profile=get_profile("h100"), dtype="float16")
    runner = object.__new__(SegmentRunner)
    runner.layer, runner.plan, runner.dtype = layer, plan, "float16"
    runner.storage = np.dtype(np.float16)
    runner.params = {"L0/qkv.weight": np.zeros((2304, 768), np.float16)}
    runner._dummy = np.zeros(8, np.float16)
    return runner, plan.segments[0]


def test_input_checks_name_value_and_shapes():
    runner, seg = _bare_runner()
    good = np.zeros((256, 768), np.float16)
    assert runner._get({"L0/input": good}, seg, "x", (256, 768)) is good
    assert runner._get({}, seg, "residual", (256, 768)) is runner._dummy  # unbound slot
    with pytest.raises(SegmentInputError, match=r"needs value 'L0/input' \(x\)"):
        runner._get({}, seg, "x", (256, 768))
    with pytest.raises(SegmentInputError, match=r"float32\[256, 768\], expected float16"):
        runner._get({"L0/input": good.astype(np.float32)}, seg, "x", (256, 768))
    with pytest.raises(SegmentInputError, match=r"\[128, 768\], expected float16\[256, 768\]"):
        runner._get({"L0/input": good[:128]}, seg, "x", (256, 768))
    with pytest.raises(SegmentInputError, match="not contiguous"):
        runner._get({"L0/input": np.zeros((768, 256), np.float16).T}, seg, "x", (256, 768))
    err = SegmentInputError("x", hint="y")
    assert "\n" not in str(err) and err.exit_code == 2
