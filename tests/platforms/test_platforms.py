"""``vllm.platforms.current_platform`` answers what upstream's kernel tests ask of it."""

from __future__ import annotations

import pytest
import torch

from vllm.platforms import CpuPlatform, CudaPlatform, DeviceCapability, current_platform
from vllm.v1.attention.backends.abstract import DeviceCapability as BackendDeviceCapability


def test_current_platform_matches_torch() -> None:
    expected = CudaPlatform if torch.cuda.is_available() else CpuPlatform
    assert isinstance(current_platform, expected)
    assert current_platform.is_cuda() == torch.cuda.is_available()
    assert current_platform.is_cpu() != current_platform.is_cuda()
    assert current_platform.fp8_dtype() is torch.float8_e4m3fn


def test_cpu_has_no_capability() -> None:
    cpu = CpuPlatform()
    assert (cpu.device_type, cpu.is_cpu(), cpu.is_cuda()) == ("cpu", True, False)
    assert cpu.get_device_capability() is None
    # Upstream's NVFP4 cases gate on has_device_capability(100): they skip on CPU.
    assert not cpu.has_device_capability(100)
    assert not cpu.has_device_capability((7, 0))


@pytest.mark.parametrize(
    ("capability", "asked", "expected"),
    [
        ((10, 0), 100, True),
        ((10, 0), 90, True),
        ((9, 0), 100, False),
        ((10, 3), (10, 0), True),
        ((8, 9), (9, 0), False),
        ((12, 0), 100, True),
    ],
)
def test_has_device_capability_int_and_tuple(
    monkeypatch: pytest.MonkeyPatch, capability, asked, expected: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device_id=0: capability)
    cuda = CudaPlatform()
    got = cuda.get_device_capability()
    assert got == capability and got.to_int() == capability[0] * 10 + capability[1]
    assert cuda.device_type == "cuda" and cuda.is_cuda()
    assert cuda.has_device_capability(asked) is expected


@pytest.mark.parametrize(
    ("capability", "family", "expected"),
    [((10, 0), 100, True), ((10, 3), 100, True), ((12, 1), 120, True), ((9, 0), 100, False)],
)
def test_is_device_capability_family(
    monkeypatch: pytest.MonkeyPatch, capability, family: int, expected: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device_id=0: capability)
    assert CudaPlatform().is_device_capability_family(family) is expected
    assert not CpuPlatform().is_device_capability_family(family)


def test_device_capability_has_one_home() -> None:
    assert BackendDeviceCapability is DeviceCapability
    hopper = DeviceCapability(9, 0)
    assert str(hopper) == "sm_90" and hopper.as_version_str() == "9.0"


def test_device_count_and_config_builder() -> None:
    """The host counts as one device; CUDA counts what torch sees. Every platform plans with
    the default KV-cache config builder unless it names its own."""
    assert CpuPlatform.device_count() == 1
    if torch.cuda.is_available():
        assert CudaPlatform.device_count() == torch.cuda.device_count()
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder

    builder = get_kv_cache_config_builder(VllmConfig())
    assert type(builder) is DefaultKVCacheConfigBuilder
    assert builder is not get_kv_cache_config_builder(VllmConfig())
