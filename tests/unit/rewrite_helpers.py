"""Test helpers shared by the package tests: the package step's rewrite of a loaded graph
(without kernels, so the ai.stofc CPU twins run it), a CPU-EP session with the custom-op
library, and a plan whose vendor GEMMs carry a tuned cuBLASLt rank."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx
import onnxruntime as ort

from stofc.frontend.types import ModelGraph
from stofc.lower.rewrite import AttentionBinding, rewrite_model
from stofc.masks import parse_mask
from stofc.masks.format import MaskFormat
from stofc.masks.spec import MaskSpec
from stofc.package.maskbin import write_mask_binary
from stofc.pipeline import encode_masks
from stofc.plan.attention import attention_inputs
from stofc.plan.build import build_plan, plan_layer
from stofc.plan.plan import Plan
from stofc.plan.scheme import FusionScheme
from stofc.targets import get_profile


def with_causal(spec: MaskSpec) -> MaskSpec:
    """``spec`` with ``causal=true`` on the default and every override."""
    def causal(o):
        return replace(o, node=replace(o.node, causal=True))
    return replace(spec, default=replace(spec.default, causal=True),
                   layers=tuple(causal(o) for o in spec.layers),
                   heads=tuple(causal(o) for o in spec.heads))


def rewrite_graph(graph: ModelGraph, mask: str, tmp_path: Path, *, max_seq_len: int,
                  tile: int = 16, dtype: str = "float16", pack_qkv: bool = True,
                  causal_from_graph: bool = False, unfused: bool = False
                  ) -> tuple[dict[int, MaskFormat], onnx.ModelProto, tuple]:
    """(formats, checked rewritten model, emitted segments) of ``graph`` on ``mask`` for an
    H100 plan; each layer's mask binary is written to ``tmp_path``. ``causal_from_graph``
    ANDs the causal mask in when the graph's attention is causal, as ``stofc compile`` does.
    ``unfused``: every chain operator a segment of its own (the plan's other extreme)."""
    spec = parse_mask(mask)
    if causal_from_graph and any(layer.attention.causal_in_graph for layer in graph.layers):
        spec = with_causal(spec)
    # no attention kernels: the fixtures' head_dim 16 has none, and the CPU twins need none
    plan = build_plan(graph, None, get_profile("h100"), dtype=dtype, max_seq_len=max_seq_len)
    if unfused:
        plan = replace(plan, layers=tuple(
            plan_layer(layer, FusionScheme.unfused(len(layer.chain)), tokens=plan.tokens,
                       profile=get_profile("h100"), dtype=dtype, qkv_store="row")
            for layer in graph.layers))
    formats = dict(encode_masks(graph, spec, max_seq_len, tile).formats)
    bindings = {}
    for layer in graph.layers:
        mask_bin = write_mask_binary(formats[layer.index], tmp_path / f"m{layer.index}.bin")
        kpm, bias = attention_inputs(layer.attention, graph.inputs)
        # package files are relative to the package directory (the library refuses others)
        bindings[layer.index] = AttentionBinding(layer.index, mask_bin.name, "", kpm, bias)
    model, emitted = rewrite_model(graph, plan, {}, bindings, pack_qkv=pack_qkv)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                        PACKAGE_DIR_PROP: str(tmp_path.absolute())})
    onnx.checker.check_model(model)
    return formats, model, emitted


PACKAGE_DIR_PROP = "stofc.test.package_dir"


def cpu_session(model: onnx.ModelProto, library: Path) -> ort.InferenceSession:
    """``model`` on ONNX Runtime's CPU EP with the stofc custom-op library registered, bound
    to the directory :func:`rewrite_graph` wrote the mask files to."""
    so = ort.SessionOptions()
    props = {p.key: p.value for p in model.metadata_props}
    if PACKAGE_DIR_PROP in props:
        so.add_session_config_entry("stofc.package_dir", props[PACKAGE_DIR_PROP])
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def with_lt_rank(plan: Plan, rank: int, m: int) -> Plan:
    """``plan`` with every vendor GEMM segment tuned to heuristic ``rank`` at ``m`` rows."""
    layers = []
    for lp in plan.layers:
        segs = []
        for s in lp.segments:
            if s.kernel.template == "vendor/cublas":
                params = tuple(p for p in s.kernel.params if p[0] not in ("lt_algo", "lt_m"))
                tuned = (*params, ("lt_algo", rank), ("lt_m", m))
                s = replace(s, kernel=replace(s.kernel, params=tuned))
            segs.append(s)
        layers.append(replace(lp, segments=tuple(segs)))
    return replace(plan, layers=tuple(layers))
