"""Small helpers shared across the package."""

from __future__ import annotations

from typing import Any


def check_positive_int(name: str, value: Any) -> int:
    """``value`` when it is a positive int (not a bool); else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value
