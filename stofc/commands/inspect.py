"""``stofc inspect``: what stofc understands of an ONNX model, per layer."""

from __future__ import annotations

import json
from collections import Counter

import click
from rich.console import Console
from rich.table import Table

from stofc.errors import StofcError
from stofc.frontend import load_model
from stofc.frontend.model_mask import model_masks
from stofc.frontend.types import ModelGraph
from stofc.kernels.attention import select_kernel
from stofc.kernels.attention.config import ExtraInputs
from stofc.masks import encode, parse_mask
from stofc.plan import build_plan
from stofc.plan.attention import attention_reads
from stofc.plan.plan import Segment
from stofc.targets import GpuProfile, get_profile

_DEFAULT_SEQ = 512


def _seq_len(graph: ModelGraph) -> int:
    """The model's static sequence length if its inputs fix one, else 512."""
    for vi in graph.inputs:
        if vi.name in (graph.padding_mask_input, "input_ids") and len(vi.shape) >= 2 \
                and isinstance(vi.shape[-1], int) and vi.shape[-1] > 0:
            return vi.shape[-1]
    return _DEFAULT_SEQ


def _mask_report(spec_text: str | None, graph: ModelGraph, profile: GpuProfile, *,
                 batch: int, seq: int) -> dict | None:
    """The --mask spec: its density at ``seq`` and the attention kernel the selector picks
    (for the first layer's heads, head_dim and node inputs: bias, key bits, soft-capping)."""
    if spec_text is None:
        return None

    report: dict = {"spec": spec_text, "seq_len": seq, "density": None, "kernel": None,
                    "why": None}
    if not graph.layers:
        return report
    att = graph.layers[0].attention
    fmt = encode(parse_mask(spec_text), seq, tile=64, layer=0, num_heads=att.num_heads)
    report["density"] = float(fmt.density)
    key_bits, bias = attention_reads(att)
    extras = ExtraInputs(has_bias=bias, has_key_bits=key_bits,
                         has_softcap=float(att.softcap or 0.0) > 0.0)
    try:
        choice = select_kernel(fmt, profile, batch=batch, heads=att.num_heads, seq_len=seq,
                               head_dim=att.head_dim, extras=extras)
    except StofcError as err:  # e.g. a head_dim no kernel supports: say so, keep inspecting
        report["why"] = str(err)
    else:
        report["kernel"], report["why"] = choice.kernel, choice.explanation
    return report


def _segment_name(seg: Segment) -> str:
    roles = ",".join(r for r in seg.roles if r)
    return f"{seg.family}({roles})" if roles else seg.family


def _segments(graph: ModelGraph, profile: GpuProfile, *, batch: int, seq: int) -> list[dict]:
    """The plan stage's starting scheme per layer (``build_plan`` without a mask)."""
    out = []
    for layer in graph.layers:
        entry: dict = {"layer": layer.index, "scheme": None, "segments": [], "error": None}
        try:
            plan = build_plan([layer], None, profile, dtype="float16", max_seq_len=seq, batch=batch)
        except StofcError as err:  # the layer stays with ONNX Runtime; inspect goes on
            entry["error"] = str(err)
        else:
            lp = plan.layers[0]
            entry["scheme"] = list(lp.scheme.codes)
            entry["segments"] = [{"name": _segment_name(s), "family": s.family,
                                  "ops": list(s.ops), "kernel": s.kernel.template}
                                 for s in lp.segments]
        out.append(entry)
    return out


def _model_masks(graph: ModelGraph) -> list[dict]:
    """Each layer's own mask (:func:`stofc.frontend.model_mask.model_masks`), or the error."""

    try:
        return [m.as_dict() for m in model_masks(graph).layers]
    except StofcError as err:
        return [{"layer": layer.index, "kind": "error", "description": str(err), "spec": None,
                 "probes": []} for layer in graph.layers]


def report(graph: ModelGraph, mask: dict | None = None, segments: list[dict] | None = None,
           model_masks: list[dict] | None = None) -> dict:
    """The JSON object ``inspect --json`` prints (keys documented on the command)."""
    return {
        "model": graph.path,
        "opset": graph.opset,
        "inputs": [{"name": v.name, "dtype": v.dtype, "shape": list(v.shape)}
                   for v in graph.inputs],
        "outputs": [{"name": v.name, "dtype": v.dtype, "shape": list(v.shape)}
                    for v in graph.outputs],
        "padding_mask_input": graph.padding_mask_input,
        "attention": [layer.attention.as_dict() for layer in graph.layers],
        "layers": [{"layer": layer.index, "norm_order": layer.norm_order,
                    "chain": [op.as_dict() for op in layer.chain]} for layer in graph.layers],
        "segments": segments if segments is not None else [],
        "segments_source": "stofc.plan.build_plan (initial scheme, no tuning)",
        "unsupported": [{"node": u.node, "op_type": u.op_type, "reason": u.reason}
                        for u in graph.unsupported],
        "left_to_ort": list(graph.left_to_ort),
        "mask": mask,
        "model_masks": model_masks if model_masks is not None else [],
    }


def _print_tables(data: dict, graph: ModelGraph) -> None:
    console = Console()
    ins = ", ".join(f"{v['name']} {v['dtype']}{v['shape']}" for v in data["inputs"])
    console.print(f"[bold]{data['model']}[/]  opset {data['opset']}  "
                  f"layers {len(graph.layers)}  inputs: {ins}")
    console.print(f"padding mask input: {data['padding_mask_input'] or '-'}")
    if data["mask"]:
        m = data["mask"]
        dens = "n/a (no layers)" if m["density"] is None else f"{m['density']:.2%}"
        console.print(f"mask: {m['spec']}  density at L={m['seq_len']}: {dens}")
        if m["why"]:
            console.print(f"attention kernel: {m['kernel'] or 'none'} ({m['why']})")
    att = Table(title="Attention blocks")
    for col in ("layer", "heads x dim", "kv heads", "qkv", "scale", "mask", "model's own mask",
                "rope", "softcap", "nodes"):
        att.add_column(col, overflow="fold")
    own = {m["layer"]: m["description"] for m in data.get("model_masks", [])}
    for a in data["attention"]:
        mask = a["mask_form"] + (f" <- {a['mask_source']}" if a["mask_source"] else "")
        rope = "; ".join(f"{r['form']}" + (f" {r['rotary_dim']}d" if r["rotary_dim"] else "")
                         for r in a.get("rope", [])[:1]) or "-"
        if a.get("rope"):   # who runs it: stofc's Rotary op, or ONNX Runtime (and why)
            rope += " (Rotary)" if a.get("rope_fusion") else " (ONNX Runtime)"
        qkv = "packed" if a["packed_qkv"] else "q,k,v"
        if a.get("layouts", {}).get("q", "bsf") != "bsf":
            qkv += f" ({a['layouts']['q']}, post-RoPE)" if a.get("rope") else \
                f" ({a['layouts']['q']})"
        att.add_row(str(a["layer"]), f"{a['num_heads']} x {a['head_dim']} = {a['hidden_size']}",
                    str(a.get("kv_num_heads", a["num_heads"])), qkv,
                    f"{a['scale']:.4g} {a['scale_form']}", mask, own.get(a["layer"], "-"), rope,
                    f"{a['softcap']:g}" if a.get("softcap") else "-", str(len(a["nodes"])))
    if data["attention"]:
        console.print(att)
    else:
        console.print("[bold]no attention block stofc can handle[/]: see the reasons below")
    for layer, seg in zip(data["layers"], data["segments"], strict=True):
        seg_of = {i: s["name"] for s in seg["segments"] for i in s["ops"]}
        table = Table(title=f"Layer {layer['layer']} chain ({layer['norm_order']}-LN)")
        for col in ("#", "op", "role", "segment", "details", "nodes"):
            table.add_column(col)
        for op in layer["chain"]:
            p = op["params"]
            details = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in p.items()
                                if k in ("in_features", "out_features", "weight_layout",
                                         "epsilon", "approximation", "form", "op", "act",
                                         "features"))
            table.add_row(str(op["index"]), op["kind"], op["role"], seg_of.get(op["index"], ""),
                          details, str(len(op["nodes"])))
        console.print(table)
        if seg["error"]:
            console.print(f"segments: none ({seg['error']})")
        else:
            console.print("segments: " + " | ".join(
                f"{s['name']}[{','.join(map(str, s['ops']))}]" for s in seg["segments"])
                + f"   scheme {' '.join(map(str, seg['scheme']))}")
    if data["unsupported"]:
        uns = Table(title="Not handled by stofc (left to ONNX Runtime)")
        uns.add_column("node", overflow="fold")
        uns.add_column("op")
        uns.add_column("reason", overflow="fold")
        for u in data["unsupported"]:
            uns.add_row(u["node"], u["op_type"], u["reason"])
        console.print(uns)
    by_type: dict[str, list[str]] = {}
    ops = {n.name: n.op_type for n in graph.model.graph.node}
    for name in data["left_to_ort"]:
        by_type.setdefault(ops.get(name, "?"), []).append(name)
    left = Table(title=f"Operators left to ONNX Runtime ({len(data['left_to_ort'])})")
    left.add_column("op")
    left.add_column("count")
    left.add_column("nodes", overflow="fold")
    counts = Counter({k: len(v) for k, v in by_type.items()})
    for op_type, count in counts.most_common():
        left.add_row(op_type, str(count), ", ".join(by_type[op_type]))
    console.print(left)


@click.command("inspect")
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@click.option("--mask", "mask_spec", default=None, metavar="SPEC",
              help="A mask spec (MASKS.md); shows its density at the model's sequence "
                   "length, or 512 when the length is dynamic.")
@click.option("--gpu", default="h100", show_default=True,
              help="GPU profile the starting plan and the kernel choice are made for.")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1),
              help="Batch size the starting plan is made for.")
@click.option("--seq-len", default=None, type=click.IntRange(min=1),
              help="Sequence length for the plan and the mask [default: the model's static "
                   "length, else 512].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (keys below).")
def inspect(model: str, mask_spec: str | None, gpu: str, batch: int, seq_len: int | None,
            as_json: bool) -> None:
    """Show the attention blocks, layer chains and fusion segments stofc finds in MODEL.

    \b
    --json prints ONE object with these stable keys:
      model, opset                 the file and its default-domain opset
      inputs, outputs              [{name, dtype, shape}] (symbolic dims as strings)
      padding_mask_input           graph input the padding mask flows from, or null
      attention                    one entry per block: layer, num_heads, head_dim,
                                   hidden_size, nodes, q_input, k_input, v_input,
                                   output, packed_qkv, scale, scale_form, mask_form,
                                   mask_source, mask_input, mask_inputs
                                   ([name, "add"|"keep"]), bias_input,
                                   softmax_guarded, causal_in_graph, rotary,
                                   kv_num_heads, layouts, softcap, rope,
                                   kv_expanded, rope_fusion ({form, rotary_dim,
                                   tables, cos, sin, position_ids, sources, nodes}
                                   when stofc's Rotary op runs the RoPE, else null),
                                   rope_refusal (why ONNX Runtime runs it, or "")
                                   (see stofc.frontend.types.AttentionBlock)
      layers                       [{layer, norm_order, chain: [{index, kind, role,
                                   nodes, inputs, outputs, params}]}]
      segments                     [{layer, scheme, segments: [{name, family, ops,
                                   kernel}], error}]: the plan stage's starting
                                   fusion scheme for --gpu/--batch/--seq-len (one
                                   value per chain operator, as STOF encodes it),
                                   its segments (chain indices) and kernel
                                   families; error says why a layer has no plan
      segments_source              which function computed the segments
      unsupported                  [{node, op_type, reason}]: every block or
                                   part of a layer stofc leaves to ONNX Runtime,
                                   with the reason (all listed at once)
      left_to_ort                  every node not covered by a layer chain
      mask                         null, or {spec, seq_len, density, kernel, why}
                                   for --mask: the attention kernel the selector
                                   picks for layer 0 and its explanation
      model_masks                  [{layer, kind, description, spec, probes}]: the
                                   mask each layer computes itself (causal,
                                   sliding window, chunked, bitmap), read by
                                   evaluating it at the probe lengths; kind
                                   "error" says why it cannot be read
    """

    profile = get_profile(gpu)
    graph = load_model(model)
    seq = seq_len or _seq_len(graph)
    data = report(graph, _mask_report(mask_spec, graph, profile, batch=batch, seq=seq),
                  _segments(graph, profile, batch=batch, seq=seq), _model_masks(graph))
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        _print_tables(data, graph)
