"""GPU profiles: what the analytical models and the compile target need to know.

Figures are the vendors' datasheet values (dense fp16 tensor-core peak without
sparsity, memory bandwidth) and the CUDA programming guide's per-architecture
limits. They steer analytical choices; the tuner measures the real thing.
``auto`` asks the GPU present (through CuPy) and maps it to a profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from stofc.errors import DeviceError, TargetError


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model. Sizes in bytes, bandwidth in GB/s, peak in TFLOP/s."""

    name: str
    full_name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_sm: int
    smem_per_block: int          # the opt-in maximum for one block
    regs_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    l2_bytes: int
    mem_bandwidth_gbs: float
    fp16_tflops: float

    @property
    def arch(self) -> str:
        """The cubin target, e.g. ``sm_90``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def ptx_target(self) -> str:
        """The PTX target for forward compatibility, e.g. ``compute_90``."""
        major, minor = self.compute_capability
        return f"compute_{major}{minor}"


_KIB = 1024
_MIB = 1024 * 1024

PROFILES: dict[str, GpuProfile] = {p.name: p for p in (
    GpuProfile("a100", "NVIDIA A100", (8, 0), 108, 164 * _KIB, 163 * _KIB, 65536, 64, 32,
               40 * _MIB, 1555.0, 312.0),
    GpuProfile("a10", "NVIDIA A10", (8, 6), 72, 100 * _KIB, 99 * _KIB, 65536, 48, 16,
               6 * _MIB, 600.0, 125.0),
    GpuProfile("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 82, 100 * _KIB, 99 * _KIB, 65536,
               48, 16, 6 * _MIB, 936.0, 71.0),
    GpuProfile("l4", "NVIDIA L4", (8, 9), 58, 100 * _KIB, 99 * _KIB, 65536, 48, 24,
               48 * _MIB, 300.0, 121.0),
    GpuProfile("l40s", "NVIDIA L40S", (8, 9), 142, 100 * _KIB, 99 * _KIB, 65536, 48, 24,
               96 * _MIB, 864.0, 362.0),
    GpuProfile("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 128, 100 * _KIB, 99 * _KIB, 65536,
               48, 24, 72 * _MIB, 1008.0, 165.0),
    GpuProfile("h100", "NVIDIA H100 80GB HBM3", (9, 0), 132, 228 * _KIB, 227 * _KIB, 65536, 64,
               32, 50 * _MIB, 3350.0, 989.0),
    GpuProfile("h200", "NVIDIA H200", (9, 0), 132, 228 * _KIB, 227 * _KIB, 65536, 64, 32,
               60 * _MIB, 4800.0, 989.0),
)}

# Substrings of the device name that identify a profile, most specific first.
_NAME_HINTS: tuple[tuple[str, str], ...] = (
    ("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("L40S", "l40s"), ("RTX 4090", "rtx4090"),
    ("RTX 3090", "rtx3090"), ("A10", "a10"), ("L4", "l4"),
)


def get_profile(name: str) -> GpuProfile:
    """The profile called ``name`` (case-insensitive), or the GPU present for ``auto``."""
    key = name.strip().lower()
    if key == "auto":
        return detect()
    if key not in PROFILES:
        raise TargetError(f"unknown GPU {name!r}",
                          hint=f"use one of: auto, {', '.join(sorted(PROFILES))}")
    return PROFILES[key]


def profile_for_device_name(device_name: str) -> GpuProfile | None:
    """Map a CUDA device name (``NVIDIA H200``) to a profile, or None if unknown."""
    for hint, key in _NAME_HINTS:
        if hint in device_name:
            return PROFILES[key]
    return None


def detect() -> GpuProfile:
    """The profile of CUDA device 0. Raises :class:`DeviceError` without a GPU."""
    try:
        import cupy  # optional: CuPy, the GPU extras
        props = cupy.cuda.runtime.getDeviceProperties(0)
    except Exception as err:
        raise DeviceError(f"no CUDA GPU found for --gpu auto ({type(err).__name__})",
                          hint="name the target GPU instead, e.g. --gpu h100") from None
    raw = props["name"]
    device_name = raw.decode() if isinstance(raw, bytes) else str(raw)
    profile = profile_for_device_name(device_name)
    if profile is None:
        raise TargetError(f"GPU {device_name!r} has no stofc profile",
                          hint=f"name the closest one with --gpu ({', '.join(sorted(PROFILES))})")
    return profile
