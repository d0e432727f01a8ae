"""Emit one plan segment as ai.stofc nodes (``cuda/ort/OPS.md``): the rewrite's node factory.

:class:`Emitter` holds the nodes being built, the converted weights and the
name maps (an unfused value's dtype twin made by a ``Cast``; a fused result's
twin). The emitters of the segment kinds, and :func:`~stofc.lower.emitters.emit_segment`
that writes a segment through the one registered for its kind, are in
:mod:`stofc.lower.emitters`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from stofc.errors import PlanError
from stofc.frontend.graph import GraphIndex

DOMAIN = "ai.stofc"
DOMAIN_VERSION = 1
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
_TAG = {"float16": "f16", "bfloat16": "bf16"}
# ``kernel_abi``: the frozen argument lists the CUDA twins launch (cuda/ort/attention_abi.h
# kAttentionKernelAbi == cuda_attrs.h kCudaLaunchAbi; 4: the kernels launched with PDL wait
# on their grid dependency, cuda/stofc/pdl.cuh).
KERNEL_ABI: int | None = 4


@dataclass(frozen=True)
class AttentionBinding:
    """What a layer's SparseAttention node reads besides Q, K and V."""

    layer: int
    mask_file: str                 # relative to the package directory
    kernel: str                    # "kernels/FILE.cubin:ENTRY"
    key_padding_mask: str | None   # a [B, S] graph input (nonzero = real token)
    bias: str | None               # an additive [B|1, H|1, S, S] value (T5, ALiBi)
    launch: tuple[tuple[str, int], ...] = ()   # block_threads, blocks_per_tile_row, smem_bytes


@dataclass(frozen=True)
class EmittedSegment:
    """How one plan segment was written into model.onnx."""

    layer: int
    ordinal: int
    family: str
    ops: tuple[str, ...]     # e.g. ("ai.stofc:FusedGemm", "ai.stofc:AddLayerNorm")
    nodes: tuple[str, ...]   # names of the emitted nodes
    note: str = ""

    def to_dict(self) -> dict:
        return {"layer": self.layer, "ordinal": self.ordinal, "family": self.family,
                "ops": list(self.ops), "nodes": list(self.nodes), "note": self.note}


class Emitter:
    """Builds the new nodes: value name maps, Casts, converted weights."""

    def __init__(self, idx: GraphIndex, dtype: str, opset: int) -> None:
        self.idx, self.dtype, self.opset = idx, dtype, opset
        self.elem, self.tag = ELEM[dtype], _TAG[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self.fused: dict[str, str] = {}    # original value -> its dtype twin, made by a fused op
        self.casts: dict[str, str] = {}    # unfused value -> its dtype twin (Cast)
        self.key_states: dict[str, str] = {}   # key_padding_mask -> its KeyPrep's key_state
        self.tables: dict[tuple[str, int | None], str] = {}   # cos/sin -> Rotary's float table
        self.kept: set[str] = set()          # the model's own nodes that run a segment
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"stofc/{stem}_{self.count}"

    def node(self, op: str, inputs: list[str], outputs: list[str], *, domain: str = "",
             stem: str = "", **attrs) -> onnx.NodeProto:
        node = helper.make_node(op, inputs, outputs, name=self.name(stem or op), domain=domain,
                                **attrs)
        self.nodes.append(node)
        return node

    def half(self, value: str) -> str:
        """``value`` in the dtype: the fused twin, the value itself, or a Cast of it."""
        if value in self.fused:
            return self.fused[value]
        if self.idx.elem_type(value) == self.elem:
            return value
        if value not in self.casts:
            twin = f"{value}::stofc_{self.tag}"
            self.node("Cast", [value], [twin], stem="cast_in", to=self.elem)
            self.casts[value] = twin
        return self.casts[value]

    def output(self, value: str) -> str:
        """The dtype name a fused op writes for ``value`` (Cast back later if read outside).

        Unique per write: when the plan names one (virtual) value for two
        results, each reader gets the latest write before it, as the plan's
        sequential order means.
        """
        twin = f"{value}::stofc_{self.tag}.out"
        if value in self.fused:
            twin = f"{twin}{self.count}"
            self.count += 1
        self.fused[value] = twin
        return twin

    def key_state(self, mask: str) -> tuple[str, onnx.NodeProto | None]:
        """``mask``'s key_state and the KeyPrep node emitted for it now (None when an
        earlier SparseAttention on the same mask emitted it: one KeyPrep per mask value)."""
        if mask in self.key_states:
            return self.key_states[mask], None
        state = f"{mask}::stofc_key_state"
        node = self.node("KeyPrep", [mask], [state], domain=DOMAIN, stem="KeyPrep")
        self.key_states[mask] = state
        return state, node

    def fp32(self, value_dt: str) -> str:
        out = f"{value_dt}::f32_{self.count + 1}"
        self.node("Cast", [value_dt], [out], stem="cast_f32", to=TensorProto.FLOAT)
        return out

    def weight(self, name: str, *, transpose: bool = False) -> str:
        """The initializer ``name`` in the dtype (transposed for NK GEMM weights)."""
        key = f"{name}::stofc_{self.tag}{'_kn' if transpose else ''}"
        if key not in self.inits:
            array = self.idx.const(name)
            if array is None:
                raise PlanError(f"weight {name!r} is not a constant",
                                hint="stofc fuses GEMMs with constant weights only")
            array = np.asarray(array, dtype=np.float32)
            if transpose:
                array = array.T
            self.inits[key] = to_tensor(np.ascontiguousarray(array), self.dtype, key)
        return key

    def weight_f32(self, name: str) -> str:
        key = f"{name}::stofc_f32"
        if key not in self.inits:
            self.inits[key] = numpy_helper.from_array(
                np.asarray(self.idx.const(name), dtype=np.float32).reshape(-1), key)
        return key


def tensor_bits(tensor: TensorProto) -> np.ndarray:
    """A float16 / bfloat16 initializer's elements as their uint16 bit patterns, in its shape."""
    if tensor.data_type not in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        raise PlanError(f"initializer {tensor.name!r} is not float16 or bfloat16",
                        hint="this is a stofc bug; report it")
    if tensor.raw_data:
        bits = np.frombuffer(tensor.raw_data, dtype="<u2")
    else:  # ONNX keeps 16-bit floats' bit patterns in int32_data without raw_data
        bits = np.asarray(tensor.int32_data, dtype=np.int64).astype(np.uint16)
    return bits.reshape(tuple(tensor.dims)).astype(np.uint16)


def bits_tensor(bits: np.ndarray, data_type: int, name: str) -> TensorProto:
    """The inverse of :func:`tensor_bits`: uint16 bit patterns as a 16-bit float initializer."""
    tensor = TensorProto(name=name, data_type=data_type, dims=list(bits.shape))
    tensor.raw_data = np.ascontiguousarray(bits, dtype="<u2").tobytes()
    return tensor


def to_tensor(array: np.ndarray, dtype: str, name: str) -> TensorProto:
    """A float array as a float16 or bfloat16 (round to nearest even) initializer."""
    if dtype == "float16":
        return numpy_helper.from_array(array.astype(np.float16), name)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    tensor = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(array.shape))
    tensor.raw_data = bits.tobytes()
    return tensor


def norm_param(em: Emitter, name: str) -> str:
    """A LayerNorm gamma / beta initializer as AddLayerNorm reads it.

    float16 packages: in the dtype. bfloat16 packages: float32 (OPS.md, AddLayerNorm
    types). bf16's 8-bit mantissa puts each channel's scale off by up to 2^-8 of itself,
    the same error on every token, compounded over the layers' norms; it alone cost
    6.3e-3 of the example's 1e-2 bound (bench/results/bf16-error-budget-cpu-2026-11-22.md).
    Mixed-precision practice keeps them float32 too (autocast runs layer_norm in fp32).
    """
    return em.weight_f32(name) if em.dtype == "bfloat16" else em.weight(name)
