"""bfloat16 packages: the residual stream of pre-norm layers is never rounded to bfloat16.

Why: in a pre-norm block (Llama, T5, GPT-2: ``h = h + f(norm(h))``) the running sum
``h`` is the residual stream, read by the next norm and by the next residual add. A bf16
package stored it in bf16 at every step: the FusedGemm adding the residual (cuBLASLt's
C) wrote ``h`` in bf16, and the next residual add read that. :mod:`stofc.lower.prenorm`
keeps a sum float32 only where a norm alone reads it (post-LN), so pre-norm layers were
not covered. Rounding the stream cost the Llama fixture's bf16 package (tests/fixtures/
llama_ts_op17.onnx) 7.6e-3 of its 1e-2 bound (1.7e-3 without); an 8-layer pre-norm
graph's package was refused by compile's check (1.2e-2; 1.7e-3 without); the issue-15
Llama (4 x 2048) went from 1.504e-2 to 1.308e-2, the rest being bf16's own rounding
(bench/bf16_llama_error_budget.py, bench/results/bf16-llama-error-budget-cpu-2026-11-26.md).
Mixed-precision practice keeps it float32 too (autocast adds residuals in float32). What
a norm reads is still rounded (an AddLayerNorm with a float x needs a bf16 residual, else
ONNX Runtime infers the float registration's output, OPS.md): noise on the fixtures, about
2e-3 on the issue-15 Llama (the emulation's ``norm_in``).

Contract of :func:`keep_stream_fp32` (a pass over the emitted ai.stofc nodes, after
:func:`~stofc.lower.prenorm.keep_pre_norm_fp32`, before the Casts back to the original
types). It uses only forms OPS.md has, the CUDA twins included:

* **A FusedGemm G that adds a residual r** (``activation = none``, a bias that is a plain
  initializer or none) **whose result h one AddLayerNorm N reads as its x** (N without a
  residual of its own) **and something else reads as well** (a later residual add, a node
  outside the fused ops): G computes ``x@w + b`` in float32 (OPS.md's float output:
  float32 bias, zeros when the model had none, no residual); N reads that as a float
  ``x`` and r as its residual (prenorm's form: the normalised sum is formed in float32);
  an ONNX ``Add`` forms ``h`` in float32 from G's float result and r's float32 value
  (below) for every other reader.
* **An AddLayerNorm with a residual and a ``sum`` output**: the sum is not written; an
  ONNX ``Add`` forms it in float32 from x's and the residual's float32 values.
* Readers of such an ``h`` (bf16 name) other than those above: a node outside the fused
  ops reads the float ``h`` (its Cast back is float to float), so does a Cast of ``h`` to
  float32 among the emitted nodes; any other reads ``Cast(h)`` to bf16 under the old name
  (a norm's residual, a GEMM operand).

The float32 value of a bf16 value v: the float ``h`` when v is a stream value; the
float32 original when v is the Cast of one (the embedding, a sum ONNX Runtime formed);
the float result of a FusedGemm in the float form; else ``Cast(v)`` to float32.

The math is the same; only roundings move. float16 packages are never touched. Cost on
a GPU: one float32 elementwise Add per stream value (and a Cast where a fused op reads
it in bf16), where cuBLASLt used to add the residual as C. Returns the emitted segments,
each rewritten one with the new nodes and ops and a ``note``.
"""

from __future__ import annotations

from dataclasses import replace

import onnx
from onnx import TensorProto, helper

from stofc.lower.emit import DOMAIN, EmittedSegment, Emitter
from stofc.lower.prenorm import _attr_text, _bias_f32

NOTE_GEMM_NORM = ("residual stream kept float32: {gemm} writes x@W+b in float32, {norm} "
                  "adds the residual, {add} forms the stream in float32 (bf16 package)")
NOTE_GEMM = ("residual stream kept float32: {gemm} writes x@W+b in float32, {add} adds the "
             "residual in float32 (bf16 package)")
NOTE_SUM = ("residual stream kept float32: {add} forms {norm}'s sum in float32 "
            "(bf16 package)")


def _is(node: onnx.NodeProto, op: str) -> bool:
    return node.domain == DOMAIN and node.op_type == op


def _attr_int(node: onnx.NodeProto, name: str) -> int | None:
    for a in node.attribute:
        if a.name == name:
            return int(helper.get_attribute_value(a))
    return None


def _residual(node: onnx.NodeProto) -> str:
    return node.input[1] if len(node.input) > 1 else ""


def keep_stream_fp32(em: Emitter, emitted: list[EmittedSegment], needed: set[str]
                     ) -> list[EmittedSegment]:
    """Keep a bf16 package's residual stream in float32 (module doc).

    ``needed`` holds the original values read outside the fused ops (unfused nodes,
    graph outputs).
    """
    if em.dtype != "bfloat16":
        return emitted
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in em.nodes:
        for name in dict.fromkeys(node.input):
            if name:
                readers.setdefault(name, []).append(node)
    outside = {twin for value, twin in em.fused.items() if value in needed}
    stream: dict[str, str] = {}                     # bf16 name -> its float32 value
    adds: list[tuple[onnx.NodeProto, str, str]] = []  # Add, its two operands (bf16 names)
    notes: dict[str, str] = {}
    new_nodes: dict[str, list[str]] = {}            # rewritten node -> nodes added for it
    owner: dict[str, str] = {}                      # stream value -> the rewritten node
    for node in list(em.nodes):
        if _is(node, "FusedGemm") and len(node.input) > 3 and node.input[3] \
                and _attr_text(node, "activation", "none") == "none":
            h = node.output[0]
            users = readers.get(h, [])
            norms = [n for n in users if _is(n, "AddLayerNorm") and n.input[0] == h
                     and list(n.input).count(h) == 1 and not _residual(n)]
            if len(norms) == 1 and (len(users) > 1 or h in outside):
                norm: onnx.NodeProto | None = norms[0]     # a stream a norm reads
            elif h in outside and not any(_is(n, "AddLayerNorm") for n in users):
                norm = None                                # a stream only read outside
            else:
                continue                  # prenorm's case (only a norm reads it), or none
            bias = _bias_f32(em, node)
            if bias is None:
                continue
            residual = node.input[3]
            # x@W+b is not the model's value h: a name whose base (before "::") is no model
            # value, so compile's check never compares it with h (selfcheck)
            y32, h32 = f"{node.name}/xw_plus_b::f32", f"{h}::f32"
            node.input[:] = [node.input[0], node.input[1], bias]
            node.output[0] = y32
            if norm is not None:
                norm.input[0] = y32
                if len(norm.input) < 2:
                    norm.input.append(residual)
                norm.input[1] = residual
            add = helper.make_node("Add", [y32, ""], [h32], name=em.name("stream_add"))
            em.nodes.insert(em.nodes.index(node) + 1, add)
            adds.append((add, "", residual))
            stream[h], owner[h] = h32, node.name
            new_nodes[node.name] = [add.name]
            if norm is None:
                notes[node.name] = NOTE_GEMM.format(gemm=node.name, add=add.name)
            else:
                notes[node.name] = notes[norm.name] = NOTE_GEMM_NORM.format(
                    gemm=node.name, norm=norm.name, add=add.name)
        elif _is(node, "AddLayerNorm") and len(node.output) > 1 and node.output[1] \
                and _residual(node):
            h, h32 = node.output[1], f"{node.output[1]}::f32"
            add = helper.make_node("Add", ["", ""], [h32], name=em.name("stream_add"))
            em.nodes.insert(em.nodes.index(node) + 1, add)
            adds.append((add, node.input[0], node.input[1]))
            del node.output[1:]
            stream[h], owner[h] = h32, node.name
            notes[node.name] = NOTE_SUM.format(add=add.name, norm=node.name)
            new_nodes[node.name] = [add.name]
    if not stream:
        return emitted
    original = {twin: value for value, twin in em.casts.items()
                if em.idx.elem_type(value) == TensorProto.FLOAT}
    float_gemm = {n.output[0] for n in em.nodes if _is(n, "FusedGemm") and len(n.input) > 2
                  and n.input[2] in em.inits
                  and em.inits[n.input[2]].data_type == TensorProto.FLOAT}

    def f32(value: str) -> str:
        """The float32 value of ``value`` (module doc)."""
        found = stream.get(value) or original.get(value)
        if found:
            return found
        return value if value in float_gemm else em.fp32(value)

    for add, a, b in adds:
        add.input[:] = [add.input[0] or f32(a), f32(b)]
    # other readers of a stream value: a Cast to float32 reads the float value; the rest
    # (fused ops reading bf16: a norm's residual, a GEMM operand) read its Cast to bf16
    made: set[str] = set()
    own = {add.name for add, _, _ in adds}
    for node in list(em.nodes):
        if node.name in own:
            continue
        for i, name in enumerate(node.input):
            if name not in stream:
                continue
            if node.domain == "" and node.op_type == "Cast" \
                    and _attr_int(node, "to") == TensorProto.FLOAT:
                node.input[i] = stream[name]
            elif name not in made:
                made.add(name)
                cast = helper.make_node("Cast", [stream[name]], [name],
                                        name=em.name("stream_cast"), to=em.elem)
                em.nodes.insert(em.nodes.index(node), cast)
                new_nodes[owner[name]].append(cast.name)
    for value, twin in list(em.fused.items()):
        if twin in stream:
            em.fused[value] = stream[twin]      # read outside: the float value itself
    return _annotate(emitted, notes, new_nodes)


def _annotate(emitted: list[EmittedSegment], notes: dict[str, str],
              new_nodes: dict[str, list[str]]) -> list[EmittedSegment]:
    """Each segment holding a rewritten node: the nodes added for it after it (and their
    ONNX ops among its ops), and the note."""
    out = []
    for e in emitted:
        extra = list(dict.fromkeys(notes[n] for n in e.nodes if n in notes))
        added = [a for n in e.nodes for a in new_nodes.get(n, [])]
        if extra or added:
            nodes: list[str] = []
            for n in e.nodes:
                nodes += [n, *new_nodes.get(n, [])]
            ops = [*e.ops, *(["onnx:Add"] if added else []),
                   *(["onnx:Cast"] if any("stream_cast" in a for a in added) else [])]
            e = replace(e, nodes=tuple(dict.fromkeys(nodes)), ops=tuple(dict.fromkeys(ops)),
                        note="; ".join([e.note, *extra] if e.note else extra))
        out.append(e)
    return out
