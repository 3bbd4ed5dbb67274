"""Small helpers shared across the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def check_positive_int(name: str, value: Any) -> int:
    """``value`` when it is a positive int (not a bool); else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def check_device(name: str, device: Any) -> torch.device:
    """``device`` as a :class:`torch.device` when this torch can use it; else ``ValueError``
    naming ``name``: a string that names no device, or a CUDA device that torch does not see
    (torch's own error comes later, an ``AssertionError`` from its lazy CUDA init)."""
    import torch  # here: ``vllm.utils`` itself stays importable without loading torch

    try:
        checked = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{name}: expected a torch device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None
    if checked.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{name}: expected a device this torch can use, got {device!r} "
                "(CUDA is not available: torch sees no CUDA device)"
            )
        if checked.index is not None and checked.index >= count:
            raise ValueError(
                f"{name}: expected cuda:0..cuda:{count - 1} (torch sees {count} CUDA "
                f"device(s)), got {device!r}"
            )
    return checked
