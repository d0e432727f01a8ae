"""The embedding in the package dtype: no float32 Gathers, Adds, LayerNorm and Cast before layer 0.

Why: stofc fuses the layers; what comes before layer 0 used to stay as the model
wrote it, in float32, with one ``Cast`` to the dtype where the first fused op
reads it. For HF BERT that is three Gathers from float32 tables, two Adds, a
float32 LayerNormalization and the Cast (~12 float32 kernels, ~0.17 ms of a
4.3 ms BERT-base run at 4 x 2048 tokens); for GPT-2 two Gathers, an Add and the
Cast.

Contract of :func:`embed_in_dtype` (a pass over the rewritten graph, after the
segments are emitted and before the result is sorted). Matched: each value V
that the emitter casts to the dtype to enter a fused op (its ``cast_in`` Cast),
when V's producers, walked back through ``Add`` nodes, end in ``Gather`` nodes
reading a float32 table, V itself being produced by a ``LayerNormalization``
over that sum, by the sum, or by a lone Gather. The region is rewritten only
when it matches exactly:

* every Gather reads a 2-D float32 initializer on axis 0 that is no graph input
  and that nothing else reads; all tables have the same width C;
* every value inside the region, V included, is float32 and is read only inside
  the region, V also by the Cast; V and the Gather results also by ``Shape``
  nodes (TorchScript exports take shapes from them), which then read the dtype
  value that replaces them: it has the same shape. A value also read by any
  other node, a graph output or a subgraph leaves the whole region unchanged;
* the LayerNormalization normalises the last axis only (axis -1 or rank-1)
  with the default stash_type and no Mean / InvStdDev output, its scale and
  bias [C] float32 initializers that only it reads (no graph inputs).

Rewritten, in the dtype (V's Cast removed, its output written by the region's
last node). Each table is stored in the dtype (:meth:`Emitter.weight`, as the fused ops'
weights); the index paths (input ids, position / token type buffers, their Slice /
Expand / ...) are kept, except in an EmbedLayerNorm (below). Then one of two forms:

* **EmbedLayerNorm** when V is a LayerNormalization over a sum of 2 or 3 Gathers whose
  index (ids) values have inferred rank 2, of a width the CUDA kernel takes (a multiple of
  8, :func:`~stofc.kernels.embed_norm.supported_width`), and no Shape node reads a
  Gather result (that value would be gone): the whole region becomes ONE ai.stofc
  ``EmbedLayerNorm`` (OPS.md) reading ``(ids_i, table_i)`` for each summand in the model's
  order (the walk's order: ``(words + token types) + positions`` for HF BERT), then gamma and
  beta as :func:`~stofc.lower.emit.norm_param` stores them (float32 in bfloat16 packages,
  :mod:`stofc.lower.prenorm`), epsilon copied. No Gather, Add or norm node is left: on a GPU
  one memory pass and one launch instead of six ONNX Runtime nodes (three element-wise
  Gathers, two Adds and the norm: ~115 us at BERT-base 1 x 8192 on an H100). The ids of the
  second and third summands that are computed from the input shapes alone
  (:mod:`stofc.lower.shape_ids`, probed up to the package's ``max_seq_len``) are not kept
  when the first summand's ids are a rank-2 graph input (they then give the op ``[B, S]``):
  sequence positions become an absent ids input (the op gathers by position), one row for
  every token a ``[1, 1]`` int64 constant; for HF BERT that removes the ~22 shape nodes
  ahead of the embedding, ~125 us of every run on a GPU. Why rank 2
  suffices: the op broadcasts ``[B or 1, S or 1]`` ids to ``[B, S]``, exactly what the
  model's Adds do with the ``[B_i, S_i, C]`` rows they gather, so the op accepts every
  input the model accepts (HF BERT's ``[1, S]`` position ids included) and the shapes need
  not be named alike (TorchScript's inferred shapes are unnamed, dynamo's say
  ``Min(P, s)`` for the positions, P the position table's rows).
* **Gathers, Adds and AddLayerNorm** otherwise (a lone Gather, a sum without a norm, ids of
  unknown rank, more than 3 summands, a Gather result read by a Shape node): each Gather
  yields the dtype directly; the Gather results are summed by ONNX ``Add`` in the dtype, in
  the model's order (less the one the norm takes as its residual, below); the
  LayerNormalization becomes ONE ai.stofc ``AddLayerNorm`` (epsilon copied; gamma / beta
  as above). Its ``residual`` takes one summand when that can be proven to have x's shape,
  as AddLayerNorm requires (no broadcasting): the last Gather result whose inferred shape
  equals the sum's, when another one has that shape as well (so the other summands add up
  to it too); then that sum is formed in float32 in the norm, one Add fewer. HF BERT adds a
  [1, S, C] position row, so its last Add cannot be folded as it is: a dynamo export, whose
  shapes name the batch and sequence, adds the token type rows in the norm instead
  (``AddLayerNorm(words + positions, token_types)``); a TorchScript export's inferred
  shapes are unnamed (``unk__``), nothing is proven, and the norm reads the whole sum with
  no residual.

Why it is safe: the same function; only the rounding moves. Each table entry
is rounded once to the dtype, as every fused weight is. EmbedLayerNorm forms the sum in
float32 in the model's order and the statistics in float32 (CPU twin: double), rounding y
once. The other form rounds the sum in the dtype instead of once by the Cast; the norm
forms ``x + residual`` and its statistics in float32 (CPU twin: double) from the rounded
summands.

bfloat16: ONNX Runtime's CPU EP (1.32, what CI runs packages on) has no
bfloat16 ``Add`` kernel (NOT_IMPLEMENTED at session creation); it runs Add in
float16, and Gather in float16 and bfloat16. ONNX Runtime's CUDA EP source
registers Add-14 and Gather for both. So a bfloat16 package rewrites a region only when no ONNX Add
remains: an EmbedLayerNorm (HF BERT's embedding: both twins take bfloat16 tables with
float32 gamma / beta; the BERT fixtures' bfloat16 packages stay at their float32-embedding
error, 6.4e-3 of the 1e-2 bound), a lone Gather (T5's token embedding), optionally under
the norm, or the norm of two summands folded as above. GPT-2's embedding (a sum without a
norm) keeps its float32 form in bfloat16 packages, and so does an embedding that starts a
pre-norm residual stream (T5's, Llama's): :mod:`stofc.lower.stream`, which runs first, makes the
stream's first float32 Add read it, so the region is read elsewhere. (Feeding a float32 sum to
AddLayerNorm's float ``x`` would run on both EPs, but
:func:`~stofc.lower.twins.annotate_cuda` knows a float ``x`` only from
a FusedGemm's float output and would compile the kernel for a bfloat16 x.)

The new nodes belong to no plan segment; the first emitted segment reading the
embedding says what was done in its ``note`` (plan.json ``segments``). The new
EmbedLayerNorm / AddLayerNorm gets its CUDA launch attributes like the others
(``annotate_cuda`` runs after the rewrite: the embedding kernel of
:mod:`stofc.kernels.embed_norm` for the node's summands, width, beta and gamma type; the
Add+Norm kernel of gamma's length).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from stofc.kernels.embed_norm import MAX_SUMMANDS, supported_width
from stofc.lower.emit import DOMAIN, EmittedSegment, Emitter, norm_param
from stofc.lower.shape_ids import Positions, Row, shape_only_ids

NOTE = "embedding in {dtype}: {ops} ({nodes}) write {value} from {dtype} tables ({gone} removed)"


@dataclass(frozen=True)
class _Region:
    """A matched embedding region ending at ``cast``'s input V."""

    cast: onnx.NodeProto                 # the emitter's cast_in of V
    nodes: tuple[onnx.NodeProto, ...]    # the model's nodes it replaces
    leaves: tuple[onnx.NodeProto, ...]   # one Gather per summand, in the model's order
    norm: onnx.NodeProto | None          # the LayerNormalization producing V, if any
    shape_readers: tuple[onnx.NodeProto, ...]   # Shape nodes reading V or a Gather result


def embed_in_dtype(em: Emitter, kept: list[onnx.NodeProto], emitted: list[EmittedSegment],
                   pinned: set[str], max_seq_len: int
                   ) -> tuple[list[onnx.NodeProto], list[EmittedSegment]]:
    """Rewrite each matching embedding region in the dtype (module doc).

    ``kept`` are the model's unfused nodes, ``pinned`` the values read where the
    nodes do not show it (graph outputs, subgraph bodies), ``max_seq_len`` the
    longest sequence the package runs (the shape-only ids are probed up to it). Returns
    ``kept`` without the replaced nodes and ``emitted`` with the note.
    """
    producer = {o: n for n in kept for o in n.output if o}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in [*kept, *em.nodes]:
        for name in dict.fromkeys(node.input):
            if name:
                readers.setdefault(name, []).append(node)
    protected = pinned | {i.name for i in em.idx.model.graph.input}
    casts = {n.output[0]: n for n in em.nodes if n.op_type == "Cast" and n.domain == ""}
    replaced: set[int] = set()
    notes: dict[int, list[str]] = {}   # emitted index -> notes
    for value, twin in list(em.casts.items()):
        region = _match(em, value, casts[twin], producer, readers, protected)
        if region is None:
            continue
        new, renamed, implicit = _emit(em, region, twin, max_seq_len)
        em.nodes.remove(region.cast)
        del em.casts[value]
        for node in region.shape_readers:
            node.input[0] = renamed[node.input[0]]
        replaced |= {id(n) for n in region.nodes}
        users = {n.name for n in em.nodes if twin in n.input}
        holder = next((i for i, e in enumerate(emitted) if users & set(e.nodes)), None)
        if holder is not None:
            notes.setdefault(holder, []).append(_note(em, region, new, twin) + implicit)
    emitted = [replace(e, note="; ".join([e.note, *notes[i]] if e.note else notes[i]))
               if i in notes else e for i, e in enumerate(emitted)]
    return [n for n in kept if id(n) not in replaced], emitted


def _match(em: Emitter, value: str, cast: onnx.NodeProto,
           producer: dict[str, onnx.NodeProto], readers: dict[str, list[onnx.NodeProto]],
           protected: set[str]) -> _Region | None:
    """The region ending at ``value`` when it matches exactly (module doc), else None."""
    top = producer.get(value)
    norm = top if top is not None and top.op_type == "LayerNormalization" else None
    nodes: dict[str, onnx.NodeProto] = {}
    if norm is not None:
        if em.idx.elem_type(value) != TensorProto.FLOAT:
            return None
        nodes[value] = norm
    leaves = _summands(em, norm.input[0] if norm else value, producer, nodes)
    if not leaves:
        return None
    inside = {id(n) for n in nodes.values()}
    shaped = {value, *(g.output[0] for g in leaves)}
    shape_readers = tuple(n for out in shaped for n in readers.get(out, [])
                          if n.op_type == "Shape" and n.domain == "")
    for out, node in nodes.items():
        if any(node.output[1:]) or out in protected:
            return None
        allowed = inside | {id(cast)} | ({id(n) for n in shape_readers} if out in shaped else set())
        if any(id(r) not in allowed for r in readers.get(out, [])):
            return None
    tables = [_sole_initializer(em, g.input[0], g, readers, protected) for g in leaves]
    if any(t is None or len(t.dims) != 2 or em.idx.attr(g, "axis", 0) != 0
           for t, g in zip(tables, leaves, strict=True)):
        return None
    widths = {int(t.dims[1]) for t in tables if t is not None}
    if len(widths) != 1:
        return None
    if norm is not None and not _norm_matches(em, norm, widths.pop(), readers, protected):
        return None
    region = _Region(cast, tuple(nodes.values()), tuple(leaves), norm, shape_readers)
    if em.dtype == "bfloat16" and not _fused(em, region) and _adds(em, region):
        return None                    # no bfloat16 Add on the CPU EP (module doc)
    return region


def _summands(em: Emitter, value: str, producer: dict[str, onnx.NodeProto],
              nodes: dict[str, onnx.NodeProto]) -> list[onnx.NodeProto] | None:
    """The Gathers whose float32 results ``value`` adds up (recording the nodes walked)."""
    node = producer.get(value)
    if node is None or em.idx.elem_type(value) != TensorProto.FLOAT or node.domain != "":
        return None
    nodes[value] = node
    if node.op_type == "Gather":
        return [node]
    if node.op_type == "Add":
        a = _summands(em, node.input[0], producer, nodes)
        b = _summands(em, node.input[1], producer, nodes)
        return a + b if a and b else None
    return None


def _sole_initializer(em: Emitter, name: str, reader: onnx.NodeProto,
                      readers: dict[str, list[onnx.NodeProto]],
                      protected: set[str]) -> TensorProto | None:
    """``name`` as a float32 initializer that only ``reader`` reads, else None."""
    tensor = em.idx.initializers.get(name)
    if tensor is None or tensor.data_type != TensorProto.FLOAT or name in protected:
        return None
    users = readers.get(name, [])
    return tensor if len(users) == 1 and users[0] is reader else None


def _norm_matches(em: Emitter, norm: onnx.NodeProto, width: int,
                  readers: dict[str, list[onnx.NodeProto]], protected: set[str]) -> bool:
    """A last-axis LayerNormalization with default stash_type and [width] parameters."""
    axis = em.idx.attr(norm, "axis", -1)
    rank = em.idx.rank(norm.input[0])
    if axis != -1 and (rank is None or axis != rank - 1):
        return False
    if em.idx.attr(norm, "stash_type", 1) != 1:
        return False
    if len(norm.input) < 2 or not norm.input[1]:
        return False
    params = [_sole_initializer(em, p, norm, readers, protected) for p in norm.input[1:3] if p]
    return all(t is not None and list(t.dims) == [width] for t in params)


def _fused(em: Emitter, region: _Region) -> bool:
    """Whether the region becomes one EmbedLayerNorm (module doc): a norm over 2 or 3
    Gathers whose ids are proven 2-D, of a width the CUDA kernel takes, no Shape node reading a
    Gather result (which would be gone)."""
    if region.norm is None or not 2 <= len(region.leaves) <= MAX_SUMMANDS:
        return False
    if any(em.idx.rank(g.input[1]) != 2 for g in region.leaves):
        return False
    if any(n.input[0] != region.cast.input[0] for n in region.shape_readers):
        return False
    table = em.idx.initializers[region.leaves[0].input[0]]
    return supported_width(int(table.dims[1]))


def _residual(em: Emitter, region: _Region) -> int | None:
    """The index of the summand AddLayerNorm can take as its residual (module doc), or None."""
    if region.norm is None:
        return None
    shape = em.idx.shape(region.norm.input[0])
    if shape is None or None in shape:
        return None
    full = [i for i, g in enumerate(region.leaves) if em.idx.shape(g.output[0]) == shape]
    return full[-1] if len(full) >= 2 else None


def _adds(em: Emitter, region: _Region) -> int:
    """How many ONNX Adds the rewritten region computes."""
    return len(region.leaves) - 1 - (_residual(em, region) is not None)


def _emit(em: Emitter, region: _Region, twin: str, max_seq_len: int
          ) -> tuple[list[onnx.NodeProto], dict[str, str], str]:
    """The region's nodes in the dtype, the last one writing ``twin``; the dtype value
    that replaces V and each Gather result; and what :func:`_ids` did, for the note."""
    first = len(em.nodes)
    if _fused(em, region):
        assert region.norm is not None
        ids, implicit = _ids(em, region, max_seq_len)
        ins = [name for g, i in zip(region.leaves, ids, strict=True)
               for name in (i, em.weight(g.input[0]))]
        ins += [""] * (2 * MAX_SUMMANDS - len(ins))
        params = [norm_param(em, p) for p in region.norm.input[1:3] if p]
        em.node("EmbedLayerNorm", [*ins, *params], [twin], domain=DOMAIN, stem="EmbedLayerNorm",
                epsilon=float(em.idx.attr(region.norm, "epsilon", 1e-5)))
        return em.nodes[first:], {region.cast.input[0]: twin}, implicit
    lone = region.norm is None and len(region.leaves) == 1
    gathered: dict[int, str] = {}
    for g in region.leaves:
        if id(g) not in gathered:
            out = twin if lone else f"{g.output[0]}::stofc_{em.tag}"
            em.node("Gather", [em.weight(g.input[0]), g.input[1]], [out], axis=0)
            gathered[id(g)] = out
    renamed = {g.output[0]: gathered[id(g)] for g in region.leaves} | {
        region.cast.input[0]: twin}
    values = [gathered[id(g)] for g in region.leaves]
    residual = _residual(em, region)
    folded = values.pop(residual) if residual is not None else ""
    x = values[0]
    for i, v in enumerate(values[1:], start=2):
        out = twin if i == len(values) and region.norm is None else em.name("embed_sum")
        em.node("Add", [x, v], [out])
        x = out
    if region.norm is not None:
        params = [norm_param(em, p) for p in region.norm.input[1:3] if p]
        em.node("AddLayerNorm", [x, folded, *params], [twin], domain=DOMAIN, stem="AddLayerNorm",
                epsilon=float(em.idx.attr(region.norm, "epsilon", 1e-5)), rms=0)
    return em.nodes[first:], renamed, ""


def _ids(em: Emitter, region: _Region, max_seq_len: int) -> tuple[list[str], str]:
    """EmbedLayerNorm's ids inputs for the region's Gathers (module doc): the model's own ids,
    except that summands after the first whose ids are computed from the input shapes alone
    (:func:`~stofc.lower.shape_ids.shape_only_ids`) take none (positions) or a ``[1, 1]``
    int64 constant (one row for every token). Only when the first ids are a rank-2 graph
    input: then they alone give the op the run's ``[B, S]``, the shape the probes fed (an
    implicit summand adds no shape). Also the note's words for what changed."""
    ids = [g.input[1] for g in region.leaves]
    if ids[0] not in em.idx.graph_inputs or em.idx.rank(ids[0]) != 2:
        return ids, ""
    said = []
    for k in range(1, len(ids)):   # ids_0 is required: it gives the op B and S
        form = shape_only_ids(em.idx, ids[k], max_seq_len)
        table = region.leaves[k].input[0]
        if isinstance(form, Positions):
            ids[k] = ""
            said.append(f"{table} by sequence position")
        elif isinstance(form, Row):
            name = em.name("ids_row")
            em.inits[name] = numpy_helper.from_array(np.full((1, 1), form.row, np.int64), name)
            ids[k] = name
            said.append(f"{table} row {form.row} for every token")
    return ids, (f"; ids computed from shapes alone read in the op: {', '.join(said)}"
                 if said else "")


def _note(em: Emitter, region: _Region, new: list[onnx.NodeProto], twin: str) -> str:
    """What the region became, for the ``note`` of the segment reading it."""
    counts = Counter(n.op_type for n in new)
    ops = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in counts.items())
    gone = Counter(n.op_type for n in region.nodes) + Counter(["Cast"])
    return NOTE.format(dtype=em.dtype, ops=ops, nodes=", ".join(n.name for n in new),
                       value=twin, gone=", ".join(f"float32 {op} x{k}" if k > 1
                                                  else f"float32 {op}" for op, k in gone.items()))
