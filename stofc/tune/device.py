"""Which GPU is present, and whether it is the one ``--gpu`` names.

Tuning measures on the GPU present, so a request for another GPU is an error
that names both. The query goes through CuPy's runtime calls
(``cudaGetDeviceCount`` / ``cudaGetDeviceProperties``), which create no CUDA
context in the tuner: kernels only ever run in the measurement worker.
"""

from __future__ import annotations

from stofc.errors import DeviceError, TargetError
from stofc.targets import PROFILES, GpuProfile, get_profile, profile_for_device_name


def present_gpu_name() -> str | None:
    """The name of CUDA device 0 (``"NVIDIA H200"``), or None when there is no GPU."""
    try:
        import cupy  # optional: CuPy, the GPU extras
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        raw = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    except Exception:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def check_gpu(requested: str) -> GpuProfile:
    """The profile to tune for: ``requested`` (or ``auto``), which must be the GPU present.

    Raises :class:`TargetError` for an unknown name or a mismatch (naming both
    GPUs), :class:`DeviceError` when no GPU is present.
    """
    wanted = None if requested.strip().lower() == "auto" else get_profile(requested)
    present = present_gpu_name()
    if present is None:
        asked = "auto" if wanted is None else wanted.name
        raise DeviceError(f"stofc tune measures on the GPU and no CUDA GPU was found "
                          f"(--gpu {asked})",
                          hint="run it on the target GPU; `stofc compile` works without one")
    found = profile_for_device_name(present)
    if found is None:
        raise TargetError(f"the GPU present, {present!r}, has no stofc profile",
                          hint=f"known GPUs: {', '.join(sorted(PROFILES))}")
    if wanted is not None and found.name != wanted.name:
        raise TargetError(f"--gpu {wanted.name} asks for an {wanted.full_name} but the GPU "
                          f"present is an {present} ({found.name})",
                          hint=f"pass --gpu {found.name} (or auto), or run on an {wanted.name}")
    return found
