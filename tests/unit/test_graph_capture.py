"""``stofc.load(..., cuda_graph=True)`` on the CPU: the provider option plumbing, the
node check against a CUDA kernel table, and the refusals (one line, naming node and fix).
The capture itself is tests/gpu/test_cuda_graph_load.py."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

import stofc
from stofc.errors import DeviceError, StofcError
from stofc.package import graph_capture
from stofc.package import load as load_mod
from stofc.package.graph_capture import (
    CPU_EP,
    CUDA_EP,
    KernelRange,
    check_capturable,
    graph_providers,
    uncapturable_node,
)

KERNELS = (KernelRange("", "Add", 7, 12), KernelRange("", "Add", 13, 13),
           KernelRange("", "Add", 14, 2**31 - 1), KernelRange("", "Gelu", 20, 2**31 - 1),
           KernelRange("com.microsoft", "Gelu", 1, 1))


def model(nodes, opset=17) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4])
    y = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT16, [1, 4])
    g = helper.make_graph(nodes, "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                               helper.make_opsetid("ai.stofc", 1),
                                               helper.make_opsetid("com.microsoft", 1)])


def test_graph_providers_default_and_merged_options():
    assert graph_providers(None) == [(CUDA_EP, {"enable_cuda_graph": "1"}), CPU_EP]
    got = graph_providers([(CUDA_EP, {"device_id": "0", "enable_cuda_graph": "0"}), CPU_EP])
    assert got == [(CUDA_EP, {"device_id": "0", "enable_cuda_graph": "1"}), CPU_EP]
    assert graph_providers([CUDA_EP]) == [(CUDA_EP, {"enable_cuda_graph": "1"})]


def test_graph_providers_without_cuda_is_refused():
    with pytest.raises(StofcError) as err:
        graph_providers([CPU_EP])
    text = str(err.value)
    assert "cuda_graph=True needs the CUDA execution provider" in text
    assert "CPUExecutionProvider" in text and "add 'CUDAExecutionProvider'" in text
    assert "\n" not in text


def test_every_node_with_a_cuda_kernel_passes():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"], name="add0"),
             helper.make_node("SparseAttention", ["a"], ["b"], name="attn", domain="ai.stofc"),
             helper.make_node("Gelu", ["b"], ["y"], name="g", domain="com.microsoft")]
    assert uncapturable_node(model(nodes), KERNELS) is None


def test_first_node_without_a_cuda_kernel_is_named():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"], name="add0"),
             helper.make_node("Erf", ["a"], ["b"], name="erf_7"),
             helper.make_node("Mod", ["b", "b"], ["y"], name="mod_9")]
    why = uncapturable_node(model(nodes), KERNELS)
    assert why is not None and "'erf_7' (Erf) has no CUDA kernel" in why


def test_a_kernel_for_another_opset_does_not_count():
    nodes = [helper.make_node("Gelu", ["x"], ["y"], name="gelu")]
    why = uncapturable_node(model(nodes, opset=17), KERNELS)    # ai.onnx Gelu is opset 20+
    assert why is not None and "'gelu' (Gelu, opset 17) has no CUDA kernel for that opset" in why
    assert uncapturable_node(model(nodes, opset=20), KERNELS) is None


def test_control_flow_and_unnamed_nodes():
    body = helper.make_graph([], "b", [], [])
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]),
             helper.make_node("If", ["a"], ["y"], then_branch=body, else_branch=body)]
    why = uncapturable_node(model(nodes), (*KERNELS, KernelRange("", "If", 1, 99)))
    assert why is not None and "'#1' is a If (control flow)" in why


def test_check_capturable_reads_the_model_file(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(model([helper.make_node("Erf", ["x"], ["y"], name="erf_7")]), str(path))
    with pytest.raises(StofcError) as err:
        check_capturable(path, lambda: KERNELS)
    text = str(err.value)
    assert text.startswith("cuda_graph=True: node 'erf_7' (Erf) has no CUDA kernel")
    assert "load it without cuda_graph=True" in text and "\n" not in text
    onnx.save(model([helper.make_node("Add", ["x", "x"], ["y"], name="a")]), str(path))
    check_capturable(path, lambda: KERNELS)


def test_load_cuda_graph_without_the_cuda_ep_is_refused(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    if CUDA_EP in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP")
    with pytest.raises(DeviceError, match="cuda_graph=True needs onnxruntime-gpu"):
        stofc.load(tmp_path, cuda_graph=True)


def test_load_cuda_graph_checks_nodes_then_asks_ort_for_the_graph(tmp_path, monkeypatch):
    """With a (pretended) CUDA EP: a node without a CUDA kernel is refused before ORT is
    asked; otherwise ORT gets enable_cuda_graph on the CUDA EP and its refusal is one line."""
    ort = pytest.importorskip("onnxruntime")
    onnx.save(model([helper.make_node("Erf", ["x"], ["y"], name="erf_7")]),
              str(tmp_path / "model.onnx"))
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA_EP, CPU_EP])
    monkeypatch.setattr(load_mod, "check_package", lambda root, providers: None)
    monkeypatch.setattr(graph_capture, "cuda_kernels", lambda: KERNELS)
    with pytest.raises(StofcError, match=r"node 'erf_7' \(Erf\) has no CUDA kernel"):
        stofc.load(tmp_path, cuda_graph=True)

    onnx.save(model([helper.make_node("Add", ["x", "x"], ["y"], name="a")]),
              str(tmp_path / "model.onnx"))
    asked = {}

    class Refusing:
        def __init__(self, path, so, providers):
            asked["providers"] = providers
            raise RuntimeError("This session cannot use the graph capture feature as requested "
                               "by the user as all compute graph nodes have not been "
                               "partitioned to the CUDA EP.\nmore")

    monkeypatch.setattr(load_mod, "session_options", lambda root: object())
    monkeypatch.setattr(ort, "InferenceSession", Refusing)
    with pytest.raises(StofcError) as err:
        stofc.load(tmp_path, [(CUDA_EP, {"device_id": "0"}), CPU_EP], cuda_graph=True)
    assert asked["providers"] == [(CUDA_EP, {"device_id": "0", "enable_cuda_graph": "1"}),
                                  CPU_EP]
    text = str(err.value)
    assert text.startswith(f"ONNX Runtime would not capture package {tmp_path} in a CUDA graph")
    assert "partitioned to the CUDA EP" in text and "\n" not in text


def test_cuda_kernel_table_of_the_installed_runtime():
    pytest.importorskip("onnxruntime")
    graph_capture.cuda_kernels.cache_clear()
    table = graph_capture.cuda_kernels()    # read in a child; empty on a CPU-only onnxruntime
    assert table is not None
    assert all(k.op and 1 <= k.since <= k.until for k in table)


def test_a_kernel_table_that_cannot_be_read_leaves_the_check_to_ort(tmp_path, monkeypatch):
    """The child reading ORT's registry crashing (the TensorRT EP without libnvinfer did
    on the H100) must not take the caller down: the static check is skipped."""
    import subprocess

    def crashed(*args, **kwargs):
        return subprocess.CompletedProcess(args, -11, stdout="", stderr="Segmentation fault")

    graph_capture.cuda_kernels.cache_clear()
    monkeypatch.setattr(graph_capture.subprocess, "run", crashed)
    try:
        assert graph_capture.cuda_kernels() is None
        model = tmp_path / "model.onnx"
        import onnx
        from onnx import TensorProto, helper
        node = helper.make_node("Erf", ["x"], ["y"])
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        onnx.save(helper.make_model(graph), str(model))
        graph_capture.check_capturable(model)           # no table: no StofcError
    finally:
        graph_capture.cuda_kernels.cache_clear()
