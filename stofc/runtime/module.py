"""Load compiled cubins into CuPy modules (cached) and launch their kernels.

One process-wide cache keyed by the compile cache key: a cubin is loaded once
per process. Launches go to the given CuPy stream (or the current one); a
launch error raises :class:`~stofc.errors.DeviceError`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from stofc.compile import CompiledKernel
from stofc.errors import DeviceError
from stofc.runtime.tensor_map import TensorMap

# cuda.h's CUfunction_attribute and CUshared_carveout values (not all CuPy builds name them)
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
CU_SHAREDMEM_CARVEOUT_MAX_SHARED = 100

_MODULES: dict[str, Any] = {}


def _cupy():
    try:
        import cupy  # optional: CuPy, the GPU extras
    except ImportError as err:  # pragma: no cover - depends on the install
        raise DeviceError("CuPy is not installed",
                          hint="install the GPU extras: pip install 'stofc[gpu]'") from err
    return cupy


def device_arch() -> str:
    """``sm_XY`` of the current CUDA device."""
    cupy = _cupy()
    major, minor = divmod(int(cupy.cuda.Device().compute_capability), 10)
    return f"sm_{major}{minor}"


@dataclass
class LoadedKernel:
    """A kernel function of a loaded module, with its dynamic shared-memory limit set."""

    name: str
    function: Any
    dynamic_smem: int = 0

    def launch(self, grid: int, block: int, args: tuple, *, stream=None) -> None:
        """Launch on ``stream`` (a ``cupy.cuda.Stream``; None = current stream)."""
        cupy = _cupy()
        if stream is None:
            stream = cupy.cuda.get_current_stream()
        try:
            self.function((grid,), (block,), args, shared_mem=self.dynamic_smem, stream=stream)
        except Exception as err:
            raise DeviceError(f"launch of {self.name} failed ({err})",
                              hint="check the inputs' shapes and the GPU state") from None


def load_kernel(kernel: CompiledKernel, entry: str, *, dynamic_smem: int = 0,
                shared_blocks: int = 1) -> LoadedKernel:
    """Load ``kernel`` (cubin or PTX) once per process and return its ``entry`` function.
    ``shared_blocks`` > 1: that many blocks must share an SM's shared memory, so the
    function asks for the largest carveout (the driver's default preference may give less)."""
    cupy = _cupy()
    if kernel.target.startswith("sm_") and kernel.target.rstrip("a") != device_arch():
        raise DeviceError(f"kernel {kernel.name} was built for {kernel.target}, "
                          f"the GPU is {device_arch()}",
                          hint=f"compile for {device_arch()} (a cubin runs on its own arch only)")
    module = _MODULES.get(kernel.key)
    if module is None:
        module = cupy.cuda.function.Module()
        try:
            module.load(kernel.binary)
        except Exception as err:
            raise DeviceError(f"cannot load {kernel.name} for {kernel.target} ({err})",
                              hint="recompile for this GPU's architecture") from None
        _MODULES[kernel.key] = module
    function = module.get_function(entry)
    if dynamic_smem > 48 * 1024 or shared_blocks > 1:
        from cupy.cuda import driver  # optional: CuPy, the GPU extras (not imported unless set)
    if dynamic_smem > 48 * 1024:
        driver.funcSetAttribute(function.ptr,
                                driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                dynamic_smem)
    if shared_blocks > 1:
        driver.funcSetAttribute(function.ptr, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                CU_SHAREDMEM_CARVEOUT_MAX_SHARED)
    return LoadedKernel(entry, function, dynamic_smem)


class BoundLaunch:
    """A kernel launch with its arguments packed once: ``launch()`` is one driver call.

    ``args`` holds CuPy arrays (passed as device pointers), numpy scalars (int32,
    int64, float32) and tensor maps (:class:`~stofc.runtime.tensor_map.TensorMap`,
    passed by value). The arrays are kept alive as long as this object. ``then``
    is a launch made right after this one on the same stream (the warp-specialised
    attention's combine kernel). Meant for repeated launches on fixed buffers
    (timing, the tuner, graphs).
    """

    def __init__(self, kernel: LoadedKernel, grid: int, block: int, args: tuple, *,
                 result=None, then: BoundLaunch | None = None) -> None:


        self.kernel, self.grid, self.block, self.result = kernel, grid, block, result
        self.then = then
        self._keep = list(args)
        values: list = []
        for a in args:
            if isinstance(a, TensorMap):
                values.append(a.as_param())
            elif isinstance(a, np.int64):
                values.append(ctypes.c_int64(int(a)))
            elif isinstance(a, np.int32):
                values.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.float32):
                values.append(ctypes.c_float(float(a)))
            elif hasattr(a, "data") and hasattr(a.data, "ptr"):
                values.append(ctypes.c_void_p(int(a.data.ptr)))
            else:
                raise TypeError(f"cannot pass {type(a).__name__} to a kernel")
        self._values = values
        self._params = (ctypes.c_void_p * len(values))(
            *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        self._params_ptr = ctypes.addressof(self._params)

    def launch(self, stream=None):
        """Launch on ``stream`` (CuPy stream; None = current); returns ``result``."""
        cupy = _cupy()
        from cupy.cuda import driver  # optional: CuPy, the GPU extras

        if self.grid > 0:
            s = stream if stream is not None else cupy.cuda.get_current_stream()
            try:
                driver.launchKernel(self.kernel.function.ptr, self.grid, 1, 1, self.block, 1, 1,
                                    self.kernel.dynamic_smem, s.ptr, self._params_ptr, 0)
            except Exception as err:
                raise DeviceError(f"launch of {self.kernel.name} failed ({err})",
                                  hint="check the inputs' shapes and the GPU state") from None
        if self.then is not None:
            self.then.launch(stream)
        return self.result
