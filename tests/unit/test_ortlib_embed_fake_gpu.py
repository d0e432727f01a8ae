"""EmbedLayerNorm's CUDA twin in ONNX Runtime without a GPU, against the recording fake driver.

The test build of ``libstofc_ort.so`` (the CUDA twins on the CPU EP) runs EmbedLayerNorm against
``cuda/ort/tests/fake_cuda.cc`` (see tests/unit/test_ortlib_fake_gpu.py): every run must make
exactly one launch of the kernel the node names, grid ``ceil(B*S / rows)``, ``tpr*rows``
threads, no shared memory, with the run's pointers (the present summands in slots 0..K-1 in
input order, the other slots any pointer) and the scalars
:func:`stofc.kernels.embed_norm.embed_norm_launch` computes (strides of ``[B, S]``, ``[1, S]``
and ``[B, 1]`` ids, a table without ids gathered by position with a null ids pointer and
strides 0 and 1, table rows, int32 ids, B, S, C, epsilon); the module is loaded once; a
kernel that does not fit the run's inputs fails the run, a kernel that is not one fails session
creation. The attribute parser itself (``parse_embed_norm_launch``) is checked through the
attribute test binary.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper

from stofc.kernels.embed_norm import (
    ARGUMENTS,
    I64,
    EmbedNormConfig,
    EmbedNormProblem,
    embed_norm_launch,
    kernel_name,
    render_embed_norm,
)
from stofc.package.ortlib import sources_dir
from tests.unit.test_ortlib_cuda import ask
from tests.unit.test_ortlib_fake_gpu import run

C = 64
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
INT = {"int64": (TensorProto.INT64, np.int64), "int32": (TensorProto.INT32, np.int32)}
ROWS = (50, 2, 11)   # table rows of the three pairs
CONFIG = EmbedNormConfig(32, 4)


def _model(tmp_path, pairs=(True, True, True), *, dtype="float16", beta=True, params_fp32=False,
           ids_types=("int64", "int64", "int64"), problem=None, **attrs):
    """One EmbedLayerNorm node (float inputs Cast in the model) naming the kernel compiled for
    ``problem`` (default: the node's own)."""
    problem = problem or EmbedNormProblem(dtype, C, sum(map(bool, pairs)), beta, params_fp32)
    name = kernel_name(problem, CONFIG)
    (tmp_path / "e.cubin").write_bytes(b"fake\0")
    elem = ELEM[dtype]
    nodes, inputs, ins = [], [], []
    for i, present in enumerate(pairs):
        if not present:
            ins += ["", ""]
            continue
        if present != "pos":   # "pos": the table alone, rows by position
            inputs.append(helper.make_tensor_value_info(f"ids{i}", INT[ids_types[i]][0], None))
        inputs.append(helper.make_tensor_value_info(f"table{i}", TensorProto.FLOAT, None))
        nodes.append(helper.make_node("Cast", [f"table{i}"], [f"table{i}t"], to=elem))
        ins += [f"ids{i}" if present != "pos" else "", f"table{i}t"]
    for p in ("gamma", "beta")[:1 + beta]:
        inputs.append(helper.make_tensor_value_info(p, TensorProto.FLOAT, None))
        if params_fp32:
            ins.append(p)
        else:
            nodes.append(helper.make_node("Cast", [p], [f"{p}t"], to=elem))
            ins.append(f"{p}t")
    node_attrs = dict(epsilon=1e-12, kernel=f"e.cubin:{name}", kernel_abi=4) | attrs
    nodes.append(helper.make_node("EmbedLayerNorm", ins, ["yt"], domain="ai.stofc",
                                  **{k: v for k, v in node_attrs.items() if v is not None}))
    nodes.append(helper.make_node("Cast", ["yt"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "t", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.stofc", 1)])
    model.ir_version = 8
    return problem, name, model


def _feeds(pairs, shapes, beta=True, ids_types=("int64", "int64", "int64"), width=C):
    f = {}
    for i, present in enumerate(pairs):
        if present:
            if present != "pos":
                f[f"ids{i}"] = np.zeros(shapes[i], INT[ids_types[i]][1])
            f[f"table{i}"] = np.ones((ROWS[i], width), np.float32)
    f["gamma"] = np.ones(width, np.float32)
    if beta:
        f["beta"] = np.zeros(width, np.float32)
    return f


CASES = [
    # pairs, ids shapes of (B, S), ids types, dtype, beta, float gamma / beta
    ((True, True, True), lambda B, S: [(B, S), (B, S), (1, S)], ("int64",) * 3, "float16", True,
     False),                                                                        # HF BERT
    ((True, False, True), lambda B, S: [(1, S), None, (B, S)], ("int32", "int64", "int64"),
     "float16", False, False),                                                      # middle omitted
    ((True, True, False), lambda B, S: [(B, S), (B, 1), None], ("int64", "int32", "int64"),
     "bfloat16", True, True),                                                       # bf16 packages
    ((True, False, False), lambda B, S: [(B, S), None, None], ("int64",) * 3, "bfloat16", False,
     False),
    ((True, True, "pos"), lambda B, S: [(B, S), (1, 1), None], ("int64",) * 3, "float16", True,
     False),                                                                        # a package's BERT
]


@pytest.mark.parametrize("pairs,shapes,ids_types,dtype,beta,params_fp32", CASES,
                         ids=["bert", "middle-omitted-int32", "bf16-f32p-b1", "one", "positions"])
def test_one_launch_per_run_with_the_documented_arguments(fake, tmp_path, pairs, shapes,
                                                          ids_types, dtype, beta, params_fp32):
    problem, name, model = _model(tmp_path, pairs, dtype=dtype, beta=beta,
                                  params_fp32=params_fp32, ids_types=ids_types)
    runs = [(2, 5), (2, 5), (3, 1), (1, 11)]
    feeds = [_feeds(pairs, shapes(B, S), beta, ids_types) for B, S in runs]
    code, out, records = run(fake, tmp_path, model, feeds)
    assert code == 0, out
    assert [r["call"] for r in records].count("module_load") == 1
    launches = [r for r in records if r["call"] == "launch"]
    assert len(launches) == len(runs)
    present = [i for i, p in enumerate(pairs) if p]
    for (B, S), launch in zip(runs, launches, strict=True):
        want = embed_norm_launch(problem, CONFIG,
                                 ids_shapes=[shapes(B, S)[i] for i in present],
                                 table_rows=[ROWS[i] for i in present],
                                 ids32=[ids_types[i] == "int32" for i in present], eps=1e-12)
        assert launch["fn"] == name
        assert launch["grid"] == [want.grid, 1, 1] == [-(-B * S // 4), 1, 1]
        assert launch["block"] == [128, 1, 1] and launch["smem"] == 0
        args = launch["args"]
        got = {n: args[n] for n, _ in want.scalars}
        assert got == pytest.approx(dict(want.scalars)), (B, S)
        slots = [(args[f"ids{k}"], args[f"table{k}"]) for k in range(3)]
        used = slots[:len(present)]
        positional = [k for k, i in enumerate(present) if pairs[i] == "pos"]
        assert all(args[f"ids{k}"] == 0 for k in positional)               # null: positions
        assert all(args[f"ids{k}"] != 0 for k in range(len(present)) if k not in positional)
        assert (len({p for pair in used for p in pair}) ==
                2 * len(used) - max(0, len(positional) - 1))                # distinct tensors
        assert all(slot == slots[0] for slot in slots[len(present):])    # not read: slot 0's
        assert args["out"] not in {p for pair in used for p in pair}
        assert (args["beta"] != args["gamma"]) == beta


def test_the_launch_scalars_follow_the_ids_and_tables():
    problem = EmbedNormProblem("float16", 768, 3, True)
    launch = embed_norm_launch(problem, CONFIG, ids_shapes=[(4, 9), (1, 9), (4, 1)],
                               table_rows=[30522, 512, 2], ids32=[False, True, True], eps=1e-12)
    assert launch.grid == 9 and launch.threads == 128
    want = {"sb0": 9, "ss0": 1, "sb1": 0, "ss1": 1, "sb2": 1, "ss2": 0, "V0": 30522, "V1": 512,
            "V2": 2, "ids32": 6, "B": 4, "S": 9, "C": 768}
    assert {k: launch.scalar(k) for k in want} == want
    assert launch.scalar("eps") == pytest.approx(1e-12)


@pytest.mark.parametrize("problem,message", [
    (EmbedNormProblem("bfloat16", C, 3, True), "compiled for bfloat16 tables of width 64, 3 "
     "summand(s), gamma in the tables' type and beta but the node gives float16 tables"),
    (EmbedNormProblem("float16", C, 2, True), "2 summand(s), gamma in the tables' type and beta but "
     "the node gives float16 tables of width 64, 3 summand(s)"),
    (EmbedNormProblem("float16", C, 3, False), "and no beta but the node gives"),
    (EmbedNormProblem("float16", C, 3, True, True), "gamma float and beta but the node gives "
     "float16 tables of width 64, 3 summand(s), gamma float16 and beta"),
    (EmbedNormProblem("float16", 2 * C, 3, True), "tables of width 128"),
], ids=["dtype", "summands", "beta", "gamma-type", "width"])
def test_a_kernel_that_does_not_fit_the_inputs_fails_the_run(fake, tmp_path, problem, message):
    _, name, model = _model(tmp_path, problem=problem)
    pairs = (True, True, True)
    code, out, records = run(fake, tmp_path, model, [_feeds(pairs, [(1, 3), (1, 3), (1, 3)])])
    assert code == 3 and f"stofc EmbedLayerNorm: kernel {name} is compiled for " in out, out
    assert message in out and "; rewrite the package" in out, out
    assert not [r for r in records if r["call"] == "launch"]


@pytest.mark.parametrize("attrs,message", [
    ({"kernel_abi": None}, "this EmbedLayerNorm node carries no CUDA launch attributes"),
    ({"kernel": None}, "attribute 'kernel' (FILE.cubin:ENTRY of the EmbedLayerNorm kernel) is "
     "required"),
    ({"kernel": "e.cubin:stofc_add_norm_float16_ln_n64_t32x4"}, "not a stofc EmbedLayerNorm "
     "kernel"),
    ({"kernel": "missing.cubin:stofc_embed_norm_float16_e3_ln_n64_t32x4"}, "missing.cubin"),
])
def test_bad_kernel_attributes_fail_session_creation(fake, tmp_path, attrs, message):
    _, _, model = _model(tmp_path, **attrs)
    pairs = (True, True, True)
    code, out, records = run(fake, tmp_path, model, [_feeds(pairs, [(1, 3), (1, 3), (1, 3)])])
    assert code == 3 and message in out, out
    assert not [r for r in records if r["call"] == "run"]


def test_an_empty_batch_launches_nothing(fake, tmp_path):
    _, _, model = _model(tmp_path)
    pairs = (True, True, True)
    code, out, records = run(fake, tmp_path, model, [_feeds(pairs, [(0, 3), (0, 3), (1, 3)])])
    assert code == 0, out
    assert not [r for r in records if r["call"] == "launch"]


ENTRY = "stofc_embed_norm_float16_e3_ln_n768_t32x4"


def test_the_attribute_parser_reads_the_entry_name(driver):
    lines = ask(driver,
                ("embed_norm", {"kernel_abi": 4, "kernel": f"kernels/e.sm_90.cubin:{ENTRY}"}),
                ("embed_norm", {"kernel_abi": 4, "kernel":
                                "k.cubin:stofc_embed_norm_bfloat16_f32p_e2_ln_ns_n1024_t64x2"}))
    assert lines == [
        f"OK bf16=0 file=kernels/e.sm_90.cubin entry={ENTRY} f32p=0 summands=3 beta=1 width=768 "
        "tpr=32 rows=4",
        "OK bf16=1 file=k.cubin entry=stofc_embed_norm_bfloat16_f32p_e2_ln_ns_n1024_t64x2 f32p=1 "
        "summands=2 beta=0 width=1024 tpr=64 rows=2"]
    for problem in (EmbedNormProblem("float16", 768, 1, True),
                    EmbedNormProblem("bfloat16", 4096, 3, False, True)):
        name = kernel_name(problem, EmbedNormConfig(128, 1))
        (line,) = ask(driver, ("embed_norm", {"kernel_abi": 4, "kernel": f"k.cubin:{name}"}))
        assert line.endswith(f"f32p={int(problem.params_fp32)} summands={problem.summands} "
                             f"beta={int(problem.has_beta)} width={problem.width} tpr=128 rows=1")


@pytest.mark.parametrize("entry,message", [
    ("stofc_embed_norm_float32_e3_ln_n768_t32x4", "not a stofc EmbedLayerNorm kernel"),
    ("stofc_embed_norm_float16_e3_rms_n768_t32x4", "not a stofc EmbedLayerNorm kernel"),
    ("stofc_embed_norm_float16_e3_ln_n768_t32x4_extra", "not a stofc EmbedLayerNorm kernel"),
    ("stofc_embed_norm_float16_e3_ln_n768_t32", "not a stofc EmbedLayerNorm kernel"),
    ("stofc_embed_norm_float16_e4_ln_n768_t32x4", "which sums 4 tables; EmbedLayerNorm sums 1 to 3"),
    ("stofc_embed_norm_float16_e3_ln_n100_t32x4", "for rows of 100 elements, not a positive "
     "multiple of 8"),
    ("stofc_embed_norm_float16_e3_ln_n768_t48x4", "with 48 threads per row and 4 rows per block"),
    ("stofc_embed_norm_float16_e3_ln_n768_t512x4", "not whole warps per row and at most 1024"),
])
def test_the_attribute_parser_refuses_other_names_in_one_line(driver, entry, message):
    (line,) = ask(driver, ("embed_norm", {"kernel_abi": 4, "kernel": f"k.cubin:{entry}"}))
    assert line.startswith("ERR ") and message in line, line


def test_the_argument_list_is_the_templates_and_documented_in_ops_md():
    """ARGUMENTS (what the twin and the GPU tests pass) = the kernel's parameters, in order, with
    the types I64 says, = OPS.md's table under the CUDA twins' "EmbedLayerNorm"."""
    source = render_embed_norm(EmbedNormProblem("float16", 768, 3, True), CONFIG).code
    params = source[source.index(f"{kernel_name(EmbedNormProblem('float16', 768, 3, True), CONFIG)}(")
                    :source.index(") {", source.index("extern \"C\""))]
    found = re.findall(r"(const \w+\*|\w+\*|long long|int|float) (?:__restrict__ )?(\w+)", params)
    assert [n for _, n in found] == list(ARGUMENTS)
    assert {n for t, n in found if t == "long long"} == I64
    assert {n for t, n in found if t == "float"} == {"eps"}
    text = (sources_dir() / "OPS.md").read_text()
    section = text[text.index("### EmbedLayerNorm"):]
    section = section[:section.index("\n### ", 4)]
    rows = re.findall(r"^\| [\d., ]+ \| (.+?) \| (ptr|i64|i32|f32) \|", section, re.M)
    documented = [(n, t) for names, t in rows for n in re.findall(r"`(\w+)`", names)]
    assert [n for n, _ in documented] == list(ARGUMENTS)
    assert {n for n, t in documented if t == "i64"} == I64
