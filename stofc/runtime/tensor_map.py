"""Tensor maps for the Tensor Memory Accelerator, encoded on the host through the driver.

The warp-specialised attention kernel loads Q, K and V tiles with
``cp.async.bulk.tensor``; each load names a 128-byte *tensor map* (CUtensorMap)
that :func:`encode_tiled` builds with ``cuTensorMapEncodeTiled`` from the CUDA
driver (``libcuda.so.1``, already loaded by CuPy). Building one is pure host work
(no device call, no synchronisation); the map is passed to the kernel by value.
A map embeds the tensor's address: :class:`TensorMapCache` keeps maps per
(address, shape, strides) so repeated launches on the same buffers reuse them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from stofc.errors import DeviceError

TENSOR_MAP_BYTES = 128
_DATA_TYPES = {"float16": 6, "bfloat16": 9}   # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZERO = 0                            # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros

_LIBCUDA: ctypes.CDLL | None = None


def _encode_fn():
    global _LIBCUDA
    if _LIBCUDA is None:
        try:
            _LIBCUDA = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise DeviceError(f"cannot load the CUDA driver libcuda.so.1 ({err})",
                              hint="run on a machine with an NVIDIA driver") from None
    fn = _LIBCUDA.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


@dataclass(frozen=True)
class TensorMap:
    """One encoded CUtensorMap: 128 bytes, passed to a kernel by value."""

    data: bytes

    def as_param(self) -> ctypes.Array:
        """A ctypes buffer holding the map (its address goes into kernelParams)."""
        return (ctypes.c_char * TENSOR_MAP_BYTES).from_buffer_copy(self.data)


def encode_tiled(address: int, dtype: str, dims: tuple[int, ...], strides: tuple[int, ...],
                 box: tuple[int, ...], steps: tuple[int, ...] | None = None) -> TensorMap:
    """Encode a tiled, 128-byte-swizzled map of a ``dtype`` tensor.

    ``dims`` innermost first (elements); ``strides`` the byte strides of dims 1..
    (``len(dims) - 1`` of them, multiples of 16); ``box`` the extent one load spans
    (its innermost extent times the element size must be <= 128 bytes for the
    swizzle); ``steps`` the element strides of the traversal (default all 1; a load
    copies ``ceil(box[i] / steps[i])`` elements of dim i, ``steps[i]`` apart, at most 8).
    Raises DeviceError with the driver's code when the driver refuses.
    """
    rank = len(dims)
    steps = steps or (1,) * rank
    if (len(strides) != rank - 1 or len(box) != rank or len(steps) != rank
            or dtype not in _DATA_TYPES):
        raise ValueError("dims, strides, box and steps must have ranks r, r-1, r and r; "
                         "dtype fp16/bf16")
    if address % 16 or any(s % 16 for s in strides):
        raise DeviceError(f"a TMA tensor needs 16-byte aligned address and strides "
                          f"(address {address:#x}, strides {strides})",
                          hint="pass contiguous tensors whose rows are multiples of 8 elements")
    raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
    at = (ctypes.addressof(raw) + 63) & ~63                       # CUtensorMap is 64-byte aligned
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    code = _encode_fn()(
        ctypes.c_void_p(at), ctypes.c_int(_DATA_TYPES[dtype]), u32(rank), ctypes.c_void_p(address),
        (u64 * rank)(*dims), (u64 * (rank - 1))(*strides), (u32 * rank)(*box),
        (u32 * rank)(*steps), ctypes.c_int(_INTERLEAVE_NONE), ctypes.c_int(_SWIZZLE_128B),
        ctypes.c_int(_L2_PROMOTION_128B), ctypes.c_int(_OOB_FILL_ZERO))
    if code != 0:
        raise DeviceError(f"cuTensorMapEncodeTiled refused dims {dims}, strides {strides}, "
                          f"box {box}, steps {steps} (CUresult {code})",
                          hint="report this as a stofc bug with the shapes")
    return TensorMap(ctypes.string_at(at, TENSOR_MAP_BYTES))


class TensorMapCache:
    """Maps by (address, dtype, dims, strides, box, steps): a bound launch on fixed buffers
    builds each once; a small LRU keeps the host cost of changing buffers bounded."""

    def __init__(self, capacity: int = 64) -> None:
        self._maps: dict[tuple, TensorMap] = {}
        self._capacity = capacity

    def get(self, address: int, dtype: str, dims: tuple[int, ...], strides: tuple[int, ...],
            box: tuple[int, ...], steps: tuple[int, ...] | None = None) -> TensorMap:
        key = (address, dtype, dims, strides, box, steps)
        hit = self._maps.pop(key, None)
        if hit is None:
            hit = encode_tiled(address, dtype, dims, strides, box, steps)
            if len(self._maps) >= self._capacity:
                self._maps.pop(next(iter(self._maps)))
        self._maps[key] = hit
        return hit
