"""Integer helpers under upstream vLLM's import path (``vllm.utils.math_utils``): ceiling
division, rounding to multiples and powers of two. Block and page arithmetic everywhere in the
library uses these."""

from __future__ import annotations

__all__ = [
    "cdiv",
    "largest_power_of_2_divisor",
    "next_power_of_2",
    "round_down",
    "round_up",
]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, without floats (exact for any size)."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for ``n`` < 1)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()


def round_up(x: int, y: int) -> int:
    """The smallest multiple of ``y`` that is ≥ ``x``."""
    return cdiv(x, y) * y


def round_down(x: int, y: int) -> int:
    """The largest multiple of ``y`` that is ≤ ``x``."""
    return (x // y) * y


def largest_power_of_2_divisor(n: int) -> int:
    """The largest power of two dividing ``n`` (its lowest set bit; ``n`` > 0)."""
    return n & -n
