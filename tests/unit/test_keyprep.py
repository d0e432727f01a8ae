"""KeyPrep and SparseAttention's ``key_state`` input (OPS.md; contract D): key padding
prepared once per run.

Checked without a GPU: the CPU twin's bytes against a numpy model of the documented
layout (int32 kv_len [B] at 0, uint64 key bits [B, ceil(S/64)] at align256(4*B)); the
CUDA twins in ONNX Runtime against the recording fake driver (test_ortlib_fake_gpu.py):
KeyPrep launches the key-prep kernel once, into its output, and SparseAttention given
key_state launches only the attention kernel with kv_len / key_bits pointing into it;
wrong key_state inputs fail the run with one clear line; a compiled package has one
KeyPrep feeding every SparseAttention and still matches the original model on the CPU EP.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from stofc.lower.rewrite import DOMAIN
from stofc.package.ortlib import build_library
from stofc.package.verify import verify_package
from stofc.pipeline import Instruments, compile_model
from tests.unit.test_ortlib_abi import CASES, cpu_runtime  # noqa: F401
from tests.unit.test_ortlib_fake_gpu import attention_package, feeds_for, run

ROOT = Path(__file__).resolve().parents[2]
NP_KPM = {TensorProto.INT64: np.int64, TensorProto.INT32: np.int32, TensorProto.BOOL: np.bool_}


def key_state_model(mask: np.ndarray) -> np.ndarray:
    """The documented key_state bytes of a [B, S] key_padding_mask (padding bytes zero)."""
    B, S = mask.shape
    W, at = -(-S // 64), -(-4 * B // 256) * 256
    real = mask != 0
    last = np.where(real.any(axis=1), S - np.argmax(real[:, ::-1], axis=1), 0) if S else \
        np.zeros(B, np.int64)
    out = np.zeros(at + 8 * B * W, np.uint8)
    out[:4 * B] = last.astype("<i4").view(np.uint8)
    padded = np.zeros((B, W * 64), bool)
    padded[:, :S] = real
    out[at:] = np.packbits(padded.ravel(), bitorder="little")
    return out


def key_state_fields(state: np.ndarray, B: int, S: int) -> tuple[list[int], list[int]]:
    """(kv_len, key-bit words) read back from key_state bytes, as the kernels read them."""
    at = -(-4 * B // 256) * 256
    kv = np.frombuffer(state[:4 * B].tobytes(), "<i4").tolist()
    words = np.frombuffer(state[at:].tobytes(), "<u8").tolist()
    return kv, words


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("lib"))


def keyprep_session(lib: Path, kpm_elem: int) -> ort.InferenceSession:
    node = helper.make_node("KeyPrep", ["kpm"], ["ks"], domain=DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("kpm", kpm_elem,
                                                                          ["B", "S"])],
                              [helper.make_tensor_value_info("ks", TensorProto.UINT8, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def masks_for(B: int, S: int, rng) -> np.ndarray:
    m = (rng.random((B, S)) < 0.8).astype(np.int64)
    if B > 1:
        m[1, S // 3:] = 0              # a padded row
        m[-1, :] = 0                   # a row without a real key: kv_len 0, no bits
    return m * rng.integers(1, 5, (B, S))  # any nonzero value is a real token


@pytest.mark.parametrize("kpm_elem", list(NP_KPM), ids=["int64", "int32", "bool"])
@pytest.mark.parametrize("B,S", [(1, 64), (1, 70), (3, 130), (70, 5), (2, 0)])
def test_cpu_twin_bytes_equal_the_documented_layout(lib, kpm_elem, B, S):
    mask = masks_for(B, S, np.random.default_rng(B * 1000 + S)).astype(NP_KPM[kpm_elem])
    (state,) = keyprep_session(lib, kpm_elem).run(None, {"kpm": mask})
    want = key_state_model(mask)
    assert state.dtype == np.uint8 and state.shape == want.shape
    assert np.array_equal(state, want)
    kv, words = key_state_fields(state, B, S)
    real = mask != 0
    for b in range(B):  # the fields themselves, independently of the byte model
        idx = np.flatnonzero(real[b])
        assert kv[b] == (idx[-1] + 1 if idx.size else 0)
        bits = [(words[b * -(-S // 64) + j // 64] >> (j % 64)) & 1 for j in range(S)]
        assert bits == real[b].astype(int).tolist()


# ---------------------------------------------------------------- CUDA twins (fake driver)


def with_key_prep(model: onnx.ModelProto, *, layers: int = 1, state_input: str | None = None
                  ) -> onnx.ModelProto:
    """``model`` (one SparseAttention with key_padding_mask ``kpm``, test_ortlib_fake_gpu)
    with ``layers`` SparseAttention nodes reading key_state from one KeyPrep of ``kpm``, or
    from the graph input ``state_input`` (uint8) instead."""
    sa = model.graph.node[0]
    del model.graph.node[:]
    state = state_input or "ks"
    if state_input is None:
        model.graph.node.append(helper.make_node("KeyPrep", ["kpm"], ["ks"], domain=DOMAIN,
                                                 name="prep"))
    else:
        model.graph.input.append(helper.make_tensor_value_info(state, TensorProto.UINT8, ["N"]))
    for i in range(layers):
        node = onnx.NodeProto()
        node.CopyFrom(sa)
        node.name = f"sa{i}"
        node.input[:] = ["q", "k", "v", "kpm", "", state]
        node.output[:] = [f"out{i}" if i else "out"]
        model.graph.node.append(node)
        if i:
            model.graph.output.append(helper.make_tensor_value_info(
                f"out{i}", TensorProto.FLOAT16, None))
    return model


@pytest.mark.parametrize("B,S", [(2, 91), (1, 70)])
def test_key_prep_launches_once_and_attention_reads_key_state(fake, cpu_runtime, tmp_path,  # noqa: F811
                                                              B, S):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=True, bias=False)
    model = with_key_prep(model, layers=2)
    feeds = feeds_for(np.random.default_rng(0), B, S, True, False)
    code, out, records = run(fake, tmp_path, model, [feeds, feeds])
    assert code == 0, out
    runs = [i for i, r in enumerate(records) if r["call"] == "run"] + [len(records)]
    at = -(-4 * B // 256) * 256
    kv_want, words_want = key_state_fields(key_state_model(feeds["kpm"]), B, S)
    for first, last in itertools.pairwise(runs):
        launches = [r for r in records[first:last] if r["call"] == "launch"]
        prep, *attn = launches
        assert prep["fn"] == "stofc_key_prep" and len(attn) == 2
        assert all(a["fn"].startswith("stofc_attn_") for a in attn)   # no key-prep of their own
        assert prep["grid"] == [B, 1, 1] and prep["block"] == [128, 1, 1] and prep["smem"] == 0
        p = prep["args"]
        assert (p["kpm_type"], p["B"], p["S"], p["key_words"]) == (1, B, S, -(-S // 64))
        assert p["words"] == p["kv_len"] + at                          # both inside one output
        for a in attn:
            args = a["args"]
            assert args["kv_len"] == p["kv_len"] and args["key_bits"] == p["words"]
            assert args["key_words"] == -(-S // 64)
            assert args["kv_len_values"] == kv_want
            assert [int(w) for w in args["key_bits_values"]] == words_want
    second = records[runs[1]:]
    assert not [r for r in second if r["call"] in ("module_load", "mem_alloc", "htod")]


def test_key_prep_first_run_under_graph_capture_is_refused(fake, tmp_path):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=True, bias=False)
    model = with_key_prep(model)
    code, out, records = run(fake, tmp_path, model,
                             [feeds_for(np.random.default_rng(0), 1, 64, True, False)],
                             STOFC_FAKE_CUDA_CAPTURING="1")
    assert code == 3 and "stofc KeyPrep" in out and "before CUDA graph capture" in out, out
    assert not [r for r in records if r["call"] in ("launch", "module_load")]


def test_wrong_size_key_state_fails_the_run(fake, tmp_path):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=True, bias=False)
    model = with_key_prep(model, state_input="ks_in")
    feeds = feeds_for(np.random.default_rng(0), 2, 64, True, False)
    good = key_state_model(feeds["kpm"])
    code, out, records = run(fake, tmp_path, model, [dict(feeds, ks_in=good[:-8])])
    assert code == 3, out
    assert f"input key_state must be uint8 [{good.size}]" in out and "got uint8 [" in out, out
    assert not [r for r in records if r["call"] == "launch"]
    code, out, records = run(fake, tmp_path, model, [dict(feeds, ks_in=good)])
    assert code == 0, out                                  # the right size is taken as given
    (attn,) = [r for r in records if r["call"] == "launch"]
    assert attn["args"]["kv_len_values"] == key_state_fields(good, 2, 64)[0]


def test_key_state_without_key_padding_mask_fails_the_run(lib, tmp_path):
    spec, L, config = CASES[0]
    _, model = attention_package(tmp_path, spec, L, config, kpm=True, bias=False)
    model = with_key_prep(model, state_input="ks_in")
    model.graph.node[0].input[3] = ""
    feeds = feeds_for(np.random.default_rng(0), 1, 64, True, False)
    onnx.save(model, str(tmp_path / "m.onnx"))
    so = ort.SessionOptions()
    so.add_session_config_entry("stofc.package_dir", str(tmp_path))
    so.register_custom_ops_library(str(lib))
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="key_state is given without key_padding_mask"):
        sess.run(None, dict(feeds, ks_in=key_state_model(feeds["kpm"])))


# ---------------------------------------------------------------- the package


def test_compiled_package_has_one_key_prep_feeding_every_attention(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    from build_model import build_model

    example = tmp_path / "model.onnx"
    onnx.save(build_model(), str(example))
    pkg = compile_model(example, "bigbird:block=16,window=3,global=1,random=1,seed=0",
                        max_seq_len=128, out_dir=tmp_path / "pkg",
                        instruments=Instruments(progress=False))
    model = onnx.load(str(pkg / "model.onnx"))
    preps = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "KeyPrep"]
    attns = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "SparseAttention"]
    assert len(preps) == 1 and len(attns) == 2
    (prep,) = preps
    graph_inputs = {i.name for i in model.graph.input}
    assert prep.input[0] in graph_inputs
    for sa in attns:
        assert len(sa.input) == 6 and sa.input[3] == prep.input[0]
        assert sa.input[4] == "" and sa.input[5] == prep.output[0]
    doc = json.loads((pkg / "plan.json").read_text())
    holders = [s for s in doc["segments"] if prep.name in s["nodes"]]
    assert len(holders) == 1 and holders[0]["family"] == "attention"
    first_attention = min((s for s in doc["segments"] if s["family"] == "attention"),
                          key=lambda s: (s["layer"], s["ordinal"]))
    assert holders[0] is first_attention
    assert "ai.stofc:KeyPrep" in holders[0]["ops"] and "KeyPrep" in holders[0]["note"]
    assert sum("ai.stofc:KeyPrep" in s["ops"] for s in doc["segments"]) == 1
    assert verify_package(pkg, cases=[(2, 128), (3, 45)]).passed
