"""Load compiled cubins into CuPy modules (cached) and launch their kernels.

One process-wide cache keyed by the compile cache key: a cubin is loaded once
per process. Launches go to the given CuPy stream (or the current one); a
launch error raises :class:`~stofc.errors.DeviceError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stofc.compile import CompiledKernel
from stofc.errors import DeviceError

_MODULES: dict[str, Any] = {}


def _cupy():
    try:
        import cupy
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


def load_kernel(kernel: CompiledKernel, entry: str, *, dynamic_smem: int = 0) -> LoadedKernel:
    """Load ``kernel`` (cubin or PTX) once per process and return its ``entry`` function."""
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
    if dynamic_smem > 48 * 1024:
        from cupy.cuda import driver
        driver.funcSetAttribute(function.ptr,
                                driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                dynamic_smem)
    return LoadedKernel(entry, function, dynamic_smem)
