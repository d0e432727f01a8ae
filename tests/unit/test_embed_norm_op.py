"""The ``ai.stofc`` ``EmbedLayerNorm`` op's CPU twin in ONNX Runtime against a float64 reference.

``EmbedLayerNorm(ids_0, table_0, ids_1?, table_1?, ids_2?, table_2?, gamma, beta?) -> y``
(cuda/ort/OPS.md): ``y[b, s] = LayerNorm(sum_i table_i[ids_i[b, s]])``, the ids broadcast to
``[B, S]`` (HF BERT's position ids are ``[1, S]``), negative ids counted from the end (ONNX
Gather). Checked against :func:`stofc.kernels.embed_norm.embed_norm_reference` (itself checked
against ONNX Gather + Add + LayerNormalization in ONNX Runtime) on random tables: 1, 2 and 3
summands (also with the middle pair omitted), ``[B, S]``, ``[1, S]`` and ``[B, 1]`` ids, int64 and
int32, a table without ids (rows by sequence position, what packages write for HF BERT's
position ids), with and without beta, float / float16 / bfloat16 tables, gamma / beta in the
tables' type or float; the bound is one rounding of the element type. An id outside ``[-V, V)``,
a sequence longer than a position table, and every malformed input fail the run with one line
naming the input. A pair is ``True`` (ids and table), ``False`` (neither) or ``"pos"`` (the
table alone).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from stofc.kernels.embed_norm import broadcast_ids, embed_norm_reference
from stofc.package.ortlib import build_library

ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
        "bfloat16": TensorProto.BFLOAT16}
ULP = {"float32": 2.0 ** -22, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
INT = {"int64": (TensorProto.INT64, np.int64), "int32": (TensorProto.INT32, np.int32)}
C = 64


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("lib"))


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` as the element type holds it (the op's inputs after the model's Cast)."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return x.astype(np.float32).astype(np.float64)


def embed_model(dtype: str, pairs: tuple[bool, bool, bool], *, beta: bool = True,
                params_fp32: bool = False, ids_type: str = "int64", eps: float = 1e-12,
                **attrs):
    """One EmbedLayerNorm node; the float tables (and gamma / beta unless ``params_fp32``)
    are Cast to ``dtype`` inside the model, y is Cast back to float."""
    elem, (int_elem, _) = ELEM[dtype], INT[ids_type]
    nodes, inputs, ins = [], [], []
    for i, present in enumerate(pairs):
        if not present:
            ins += ["", ""]
            continue
        if present != "pos":
            inputs.append(helper.make_tensor_value_info(f"ids{i}", int_elem, None))
        inputs.append(helper.make_tensor_value_info(f"table{i}", TensorProto.FLOAT, None))
        nodes.append(helper.make_node("Cast", [f"table{i}"], [f"table{i}t"], to=elem))
        ins += [f"ids{i}" if present != "pos" else "", f"table{i}t"]
    for name in ("gamma", "beta")[:1 + beta]:
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
        if params_fp32:
            ins.append(name)
        else:
            nodes.append(helper.make_node("Cast", [name], [f"{name}t"], to=elem))
            ins.append(f"{name}t")
    nodes.append(helper.make_node("EmbedLayerNorm", ins, ["yt"], domain="ai.stofc", epsilon=eps,
                                  **attrs))
    nodes.append(helper.make_node("Cast", ["yt"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "embed", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return model


def session(lib, model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds_for(rng, pairs, ids_shapes, rows, ids_type="int64", *, negative=False,
              beta=True) -> dict:
    """Random tables of ``rows`` rows and ids of ``ids_shapes`` (some negative when asked)."""
    f: dict = {}
    for i, present in enumerate(pairs):
        if not present:
            continue
        if present != "pos":
            ids = rng.integers(0, rows[i], ids_shapes[i])
            if negative:
                ids = np.where(rng.random(ids.shape) < 0.5, ids - rows[i], ids)
            f[f"ids{i}"] = ids.astype(INT[ids_type][1])
        f[f"table{i}"] = (rng.standard_normal((rows[i], C)) * (i + 1)).astype(np.float32)
    f["gamma"] = rng.uniform(0.5, 1.5, C).astype(np.float32)
    if beta:
        f["beta"] = rng.standard_normal(C).astype(np.float32)
    return f


def reference(f: dict, pairs, dtype: str, params_fp32: bool, eps: float = 1e-12) -> np.ndarray:
    present = [i for i, p in enumerate(pairs) if p]
    p_dtype = "float32" if params_fp32 else dtype
    return embed_norm_reference([f.get(f"ids{i}") for i in present],
                                [_round(f[f"table{i}"], dtype) for i in present],
                                _round(f["gamma"], p_dtype),
                                _round(f["beta"], p_dtype) if "beta" in f else None, eps)


B, S = 3, 7
CASES = [
    # dtype, pairs present, ids shapes, beta, params float, ids type, negative ids
    ("float16", (True, True, True), [(B, S), (B, S), (1, S)], True, False, "int64", False),  # BERT
    ("float16", (True, True, False), [(B, S), (1, S), None], True, False, "int64", True),
    ("float16", (True, True, True), [(1, S), (B, S), (B, 1)], False, False, "int32", True),
    ("float16", (True, False, True), [(B, S), None, (1, S)], True, False, "int64", False),
    ("float16", (True, False, False), [(B, S), None, None], True, False, "int64", True),
    ("bfloat16", (True, True, True), [(B, S), (B, S), (1, S)], True, True, "int64", False),
    ("bfloat16", (True, True, False), [(B, S), (B, S), None], False, True, "int64", True),
    ("bfloat16", (True, True, True), [(B, S), (1, S), (1, S)], True, False, "int32", True),
    ("float32", (True, True, True), [(B, S), (B, S), (1, S)], True, False, "int64", True),
    # a package's HF BERT: token types as a [1, 1] constant, positions without ids
    ("float16", (True, True, "pos"), [(B, S), (1, 1), None], True, False, "int64", False),
    ("bfloat16", (True, True, "pos"), [(B, S), (1, 1), None], True, True, "int32", True),
    ("float16", (True, False, "pos"), [(B, S), None, None], False, False, "int64", True),
]


@pytest.mark.parametrize("case", CASES, ids=[
    f"{c[0]}-{''.join('p' if p == 'pos' else 'x' if p else '_' for p in c[1])}-"
    f"{'/'.join('x'.join(map(str, s)) for s in c[2] if s)}-{'b' if c[3] else 'nb'}-"
    f"{'f32p' if c[4] else 'tp'}-{c[5]}{'-neg' if c[6] else ''}" for c in CASES])
def test_cpu_twin_matches_the_float64_reference(lib, case):
    dtype, pairs, shapes, beta, params_fp32, ids_type, negative = case
    rng = np.random.default_rng(sum(map(ord, repr(case))))
    rows = (50, 2, 11)
    sess = session(lib, embed_model(dtype, pairs, beta=beta, params_fp32=params_fp32,
                                    ids_type=ids_type))
    f = feeds_for(rng, pairs, shapes, rows, ids_type, negative=negative, beta=beta)
    (got,) = sess.run(None, f)
    want = reference(f, pairs, dtype, params_fp32)
    assert got.shape == want.shape == (B, S, C)
    assert np.abs(got - want).max() <= ULP[dtype] * np.abs(want).max()


def test_the_reference_is_onnx_gather_add_layernorm():
    """embed_norm_reference = ONNX Gather x3, Add x2 (broadcasting) and LayerNormalization in
    ONNX Runtime (float32), negative ids included."""
    rng = np.random.default_rng(3)
    f = feeds_for(rng, (True, True, True), [(B, S), (B, S), (1, S)], (50, 2, 11), negative=True)
    inits = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in
             ("table0", "table1", "table2", "gamma", "beta")]
    ids = [helper.make_tensor_value_info(f"ids{i}", TensorProto.INT64, None) for i in range(3)]
    nodes = [helper.make_node("Gather", [f"table{i}", f"ids{i}"], [f"g{i}"], axis=0)
             for i in range(3)]
    nodes += [helper.make_node("Add", ["g0", "g1"], ["a"]), helper.make_node("Add", ["a", "g2"], ["x"]),
              helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1,
                               epsilon=1e-12)]
    graph = helper.make_graph(nodes, "ref", ids + inits,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (want,) = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, f)
    got = reference(f, (True, True, True), "float32", False)
    assert np.abs(got - want).max() <= 1e-5


def test_broadcast_ids_names_the_shapes():
    assert broadcast_ids([(2, 5), (1, 5), (2, 1)]) == (2, 5)
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_ids([(2, 5), (3, 5)])
    with pytest.raises(ValueError, match="not all"):
        broadcast_ids([(2, 5, 1)])


def _error(lib, model, feeds) -> str:
    with pytest.raises(Exception) as err:   # onnxruntime's own exception types
        session(lib, model).run(None, feeds)
    return str(err.value).strip()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_id_outside_the_table_fails_the_run_in_one_line(lib, dtype):
    rng = np.random.default_rng(0)
    pairs = (True, True, True)
    f = feeds_for(rng, pairs, [(B, S), (B, S), (1, S)], (50, 2, 11))
    model = embed_model(dtype, pairs)
    for bad in (2, -3):
        g = dict(f, ids1=f["ids1"].copy())
        g["ids1"][1, 4] = bad
        text = _error(lib, model, g)
        assert "\n" not in text
        assert (f"stofc EmbedLayerNorm: input ids_1 holds {bad} for token (1, 4), outside [-2, 2) "
                "for the 2 rows of table_1") in text, text
    g = dict(f, ids2=np.full((1, S), -11, np.int64))   # -V is row 0: fine
    (got,) = session(lib, model).run(None, g)
    assert np.isfinite(got).all()


def test_a_sequence_longer_than_a_position_table_fails_the_run_in_one_line(lib):
    pairs = (True, True, "pos")
    f = feeds_for(np.random.default_rng(5), pairs, [(1, 12), (1, 1), None], (50, 2, 11))
    text = _error(lib, embed_model("float16", pairs), f)
    assert "\n" not in text
    assert ("stofc EmbedLayerNorm: the sequence has 12 tokens but table_2 (rows by position, no "
            "ids_2) has 11 rows; run sequences of at most 11 tokens") in text, text
    f = feeds_for(np.random.default_rng(5), pairs, [(2, 11), (1, 1), None], (50, 2, 11))
    (got,) = session(lib, embed_model("float16", pairs)).run(None, f)   # 11 tokens fit
    assert np.isfinite(got).all()


BAD = [
    # what is changed, the message
    ({"ids1": np.zeros((2, S), np.int64)}, "input ids_1 has shape [2, 7], expected [B or 1, S or 1] "
     "broadcasting with [3, 7]"),
    ({"ids0": np.zeros((B, S, 1), np.int64)}, "input ids_0 has shape [3, 7, 1], expected [B or 1, S "
     "or 1]"),
    ({"table1": np.zeros((2, C + 8), np.float32)}, "input table_1 has shape [2, 72], expected "
     "[V, 64] (table_0's width)"),
    ({"gamma": np.ones(C + 1, np.float32)}, "input gamma has shape [65], expected [64]"),
    ({"beta": np.ones(3, np.float32)}, "input beta has shape [3], expected [64]"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m.split(" has")[0] for _, m in BAD])
def test_malformed_inputs_fail_the_run_naming_the_input(lib, change, message):
    rng = np.random.default_rng(1)
    pairs = (True, True, True)
    f = feeds_for(rng, pairs, [(B, S), (B, S), (1, S)], (50, 2, 11)) | change
    text = _error(lib, embed_model("float16", pairs), f)
    assert "\n" not in text and f"stofc EmbedLayerNorm: {message}" in text, text


def test_bad_types_and_pairs_fail_naming_the_input(lib):
    rng = np.random.default_rng(2)
    f = feeds_for(rng, (True, True, False), [(B, S), (1, S), None], (50, 2, 11))
    # ids of a float type
    model = embed_model("float16", (True, True, False))
    for node in model.graph.node:
        if node.op_type == "EmbedLayerNorm":
            node.input[2] = "ids1f"
    model.graph.node.insert(0, helper.make_node("Cast", ["ids1"], ["ids1f"], to=TensorProto.FLOAT))
    text = _error(lib, model, f)
    assert "input ids_1 is float; it must be int64 or int32" in text, text
    # a pair given half
    model = embed_model("float16", (True, True, False))
    node = next(n for n in model.graph.node if n.op_type == "EmbedLayerNorm")
    node.input[3] = ""
    model.graph.node.remove(next(n for n in model.graph.node if n.output[0] == "table1t"))
    model.graph.input.remove(next(i for i in model.graph.input if i.name == "table1"))
    text = _error(lib, model, {k: v for k, v in f.items() if k != "table1"})
    assert ("input table_1 is omitted but ids_1 is given; give both, neither, or the table alone "
            "(rows by position)") in text, text
    # gamma in float16 with beta in float
    model = embed_model("float16", (True, True, False))
    node = next(n for n in model.graph.node if n.op_type == "EmbedLayerNorm")
    node.input[7] = "beta"
    text = _error(lib, model, f)
    assert "input beta is float but gamma is float16; give gamma and beta one type" in text, text


def test_a_bad_epsilon_fails_session_creation(lib):
    with pytest.raises(Exception, match="attribute epsilon must be a finite number >= 0"):
        session(lib, embed_model("float16", (True, True, False), eps=-1.0))


def test_an_empty_batch_gives_an_empty_output(lib):
    pairs = (True, True, False)
    f = feeds_for(np.random.default_rng(4), pairs, [(0, S), (1, S), None], (50, 2, 11))
    (got,) = session(lib, embed_model("float16", pairs)).run(None, f)
    assert got.shape == (0, S, C)
