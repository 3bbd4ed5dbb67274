"""The platform contract that upstream vLLM's kernel tests ask of ``current_platform``.

Only what those tests and our backends use: the device kind (``device_type``, :meth:`is_cuda`,
:meth:`is_cpu`, :meth:`is_rocm`, :meth:`is_xpu`, :meth:`is_cuda_alike`, :meth:`is_zen_cpu`),
the host's CPU architecture, the CUDA compute capability, and the FP8 dtype of the platform.
"""

from __future__ import annotations

import enum
import platform
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig


class CpuArchEnum(enum.Enum):
    """The host's CPU architecture family (from the machine name the OS reports)."""

    X86 = enum.auto()
    ARM = enum.auto()
    POWERPC = enum.auto()
    S390X = enum.auto()
    RISCV = enum.auto()
    OTHER = enum.auto()
    UNKNOWN = enum.auto()


def _cpu_architecture(machine: str) -> CpuArchEnum:
    """The family of an OS machine name (``platform.machine()``); ``UNKNOWN`` when empty."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return CpuArchEnum.X86
    if machine.startswith(("arm", "aarch")):
        return CpuArchEnum.ARM
    if machine.startswith("ppc"):
        return CpuArchEnum.POWERPC
    if machine == "s390x":
        return CpuArchEnum.S390X
    if machine.startswith("riscv"):
        return CpuArchEnum.RISCV
    return CpuArchEnum.OTHER if machine else CpuArchEnum.UNKNOWN


class DeviceCapability(NamedTuple):
    """CUDA compute capability ``major.minor`` (sm_90 is ``(9, 0)``)."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """``major * 10 + minor`` (sm_100 is 100)."""
        return self.major * 10 + self.minor

    def __str__(self) -> str:
        return f"sm_{self.to_int()}"


class Platform:
    """A device kind. Subclasses set :attr:`device_type` and, for GPUs, report a capability."""

    device_type: ClassVar[str] = ""

    @classmethod
    def is_cuda(cls) -> bool:
        return cls.device_type == "cuda"

    @classmethod
    def is_cpu(cls) -> bool:
        return cls.device_type == "cpu"

    @classmethod
    def is_rocm(cls) -> bool:
        """ROCm devices are not a platform of this library: always False."""
        return False

    @classmethod
    def is_xpu(cls) -> bool:
        """Intel XPUs are not a platform of this library: always False."""
        return False

    @classmethod
    def is_cuda_alike(cls) -> bool:
        """CUDA or ROCm (the devices that take CUDA-style code)."""
        return cls.is_cuda() or cls.is_rocm()

    @classmethod
    def is_zen_cpu(cls) -> bool:
        """Whether this is the CPU platform on an AMD Zen host with zentorch (CPU only)."""
        return False

    @classmethod
    def device_count(cls) -> int:
        """How many devices of this platform the process sees (the host: 1)."""
        return 1

    @classmethod
    def get_kv_cache_config_builder_cls(cls, vllm_config: VllmConfig) -> str:
        """Qualified class name of the KV-cache config builder this platform plans with
        (grouping and tensor placement; see :mod:`vllm.v1.core.kv_cache_config_builder`). A
        platform with its own builder overrides this."""
        return "vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder"

    @classmethod
    def get_cpu_architecture(cls) -> CpuArchEnum:
        """The host's CPU architecture family."""
        return _cpu_architecture(platform.machine())

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        """Compute capability of device ``device_id``; ``None`` where there is none (CPU)."""
        return None

    @classmethod
    def has_device_capability(cls, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        """Whether device ``device_id`` has at least ``capability``: ``(major, minor)`` or the
        int ``major * 10 + minor`` (100 is sm_100). False when it reports no capability."""
        current = cls.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current >= capability
        return current.to_int() >= capability

    @classmethod
    def is_device_capability_family(cls, capability: int, device_id: int = 0) -> bool:
        """Whether device ``device_id`` has the major version of ``capability`` (the int
        ``major * 10 + minor``): CUDA 13's architecture families (10.x, 12.x). False when it
        reports no capability."""
        current = cls.get_device_capability(device_id)
        return current is not None and current.to_int() // 10 == capability // 10

    @classmethod
    def fp8_dtype(cls) -> torch.dtype:
        """The FP8 dtype of ``kv_cache_dtype="fp8"`` on this platform (OCP e4m3)."""
        return torch.float8_e4m3fn
