"""GPU profiles: names, archs, unknown names."""

from __future__ import annotations

import pytest

from stofc.errors import TargetError
from stofc.targets import PROFILES, get_profile, profile_for_device_name


def test_required_profiles_exist():
    for name in ("a100", "a10", "l4", "l40s", "rtx3090", "rtx4090", "h100", "h200"):
        profile = get_profile(name.upper())
        assert profile.sm_count > 0 and profile.smem_per_block <= profile.smem_per_sm


def test_arch_strings():
    assert get_profile("a100").arch == "sm_80"
    assert get_profile("rtx4090").arch == "sm_89"
    assert get_profile("h200").ptx_target == "compute_90"


def test_device_names_map_to_profiles():
    assert profile_for_device_name("NVIDIA H100 80GB HBM3") is PROFILES["h100"]
    assert profile_for_device_name("NVIDIA H200") is PROFILES["h200"]
    assert profile_for_device_name("NVIDIA A100-SXM4-80GB") is PROFILES["a100"]
    assert profile_for_device_name("NVIDIA L40S") is PROFILES["l40s"]
    assert profile_for_device_name("Tesla T4") is None


def test_unknown_gpu_lists_choices():
    with pytest.raises(TargetError, match=r"unknown GPU 'v100'.*h100"):
        get_profile("v100")
