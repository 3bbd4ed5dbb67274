"""Page-locking host memory for device copies (``cudaHostRegister``), so copies between the
shared offload region and GPU memory run as DMA; a range that cannot be registered stays
pageable (copies still work, slower)."""

from __future__ import annotations

import functools
import logging

import torch

from vllm.platforms import current_platform

logger = logging.getLogger(__name__)


class CudaRTLibrary:
    """The CUDA runtime calls host registration needs, as ints (``cudaError_t``)."""

    def __init__(self) -> None:
        self._cudart = torch.cuda.cudart()

    @staticmethod
    def _code(result: object) -> int:
        return int(getattr(result, "value", result))

    def cudaHostRegister(self, ptr: int, num_bytes: int) -> int:  # noqa: N802 (CUDA's name)
        return self._code(self._cudart.cudaHostRegister(ptr, num_bytes, 0))

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 (CUDA's name)
        return self._code(self._cudart.cudaHostUnregister(ptr))

    def cudaGetLastError(self) -> int:  # noqa: N802 (CUDA's name)
        """Clear the runtime's sticky last error (a refused registration sets it)."""
        return self._code(self._cudart.cudaGetLastError())


@functools.cache
def _get_cudart() -> CudaRTLibrary:
    return CudaRTLibrary()


def _load_cudart() -> CudaRTLibrary | None:
    try:
        return _get_cudart()
    except (AssertionError, AttributeError, OSError, RuntimeError):
        logger.warning("no CUDA runtime for host registration; memory stays pageable")
        return None


def host_register(ptr: int, num_bytes: int) -> bool:
    """Page-lock ``num_bytes`` bytes of host memory at address ``ptr``; True when registered
    (then :func:`host_unregister` must release it), False when the range stays pageable (not
    a CUDA-like platform, or the runtime refused)."""
    if not ptr or num_bytes <= 0 or not current_platform.is_cuda_alike():
        return False
    cudart = _load_cudart()
    if cudart is None:
        return False
    result = cudart.cudaHostRegister(ptr, num_bytes)
    if result != 0:
        cudart.cudaGetLastError()
        logger.warning(
            "cudaHostRegister of %d bytes failed (code %d); copies from that host memory are "
            "unpinned and slower",
            num_bytes,
            result,
        )
        return False
    return True


def host_unregister(ptr: int) -> None:
    """Release a range :func:`host_register` registered (failures are logged)."""
    if not ptr or not current_platform.is_cuda_alike():
        return
    cudart = _load_cudart()
    if cudart is None:
        return
    result = cudart.cudaHostUnregister(ptr)
    if result != 0:
        cudart.cudaGetLastError()
        logger.warning("cudaHostUnregister failed (code %d)", result)
