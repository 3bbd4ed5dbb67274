"""Lloyd-Max scalar quantizer for one coordinate of a Hadamard-rotated unit vector (upstream
v0.33.0's ``solve_lloyd_max`` / ``get_centroids``, also at upstream's
``vllm.model_executor.layers.quantization.turboquant.centroids``).

After rotation each coordinate of a ``d``-dim unit vector is close to ``N(0, 1/d)``. The solver
alternates midpoint boundaries and conditional means on that density, with the integrals taken
by a 200-interval trapezoid rule in float64, in a fixed operation order: the fp32 tables it
returns are part of the cache format (they decide every key code), so they must match upstream
bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from vllm.kv_quant.hadamard import hadamard_matrix

__all__ = ["TurboQuantTables", "get_centroids", "solve_lloyd_max", "turboquant_tables"]

_TRAPEZOIDS = 200
_INIT_SPAN_SIGMAS = 3.5  # initial centroids spread uniformly over +-3.5 sigma
_OUTER_EDGE_FACTOR = 3  # the outermost cells end at +-10.5 sigma (tails beyond are negligible)
_EMPTY_CELL_MASS = 1e-15  # a cell with less probability keeps its centroid


def _trapezoid(f: Callable[[float], float], a: float, b: float) -> float:
    step = (b - a) / _TRAPEZOIDS
    total = 0.5 * (f(a) + f(b))
    for i in range(1, _TRAPEZOIDS):
        total += f(a + i * step)
    return total * step


def _midpoints(centroids: list[float]) -> list[float]:
    return [(lo + hi) / 2.0 for lo, hi in zip(centroids[:-1], centroids[1:], strict=True)]


def solve_lloyd_max(
    d: int, bits: int, max_iter: int = 200, tol: float = 1e-10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids (``2**bits``, ascending) and decision boundaries (``2**bits - 1``, the
    midpoints of adjacent centroids) of the Lloyd-Max quantizer for ``N(0, 1/d)``, as fp32.
    Iterates until no centroid moves by ``tol`` or more, at most ``max_iter`` times."""
    if not isinstance(d, int) or d <= 0:
        raise ValueError(f"d: expected a positive int, got {d!r}")
    if not isinstance(bits, int) or bits <= 0:
        raise ValueError(f"bits: expected a positive int, got {bits!r}")
    levels = 2**bits
    variance = 1.0 / d
    sigma = math.sqrt(variance)
    norm = 1.0 / math.sqrt(2 * math.pi * variance)

    def density(x: float) -> float:
        return norm * math.exp(-x * x / (2 * variance))

    def moment(x: float) -> float:
        return x * density(x)

    lo, hi = -_INIT_SPAN_SIGMAS * sigma, _INIT_SPAN_SIGMAS * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(max_iter):
        edges = [lo * _OUTER_EDGE_FACTOR, *_midpoints(centroids), hi * _OUTER_EDGE_FACTOR]
        updated = []
        for i in range(levels):
            mass = _trapezoid(density, edges[i], edges[i + 1])
            first = _trapezoid(moment, edges[i], edges[i + 1])
            updated.append(first / mass if mass > _EMPTY_CELL_MASS else centroids[i])
        if max(abs(new - old) for new, old in zip(updated, centroids, strict=True)) < tol:
            break
        centroids = updated
    return (
        torch.tensor(centroids, dtype=torch.float32),
        torch.tensor(_midpoints(centroids), dtype=torch.float32),
    )


@lru_cache(maxsize=32)
def get_centroids(d: int, bits: int) -> torch.Tensor:
    """The centroids of :func:`solve_lloyd_max` ``(d, bits)``, computed once per pair (the same
    tensor object each call: do not modify it)."""
    return solve_lloyd_max(d, bits)[0]


@dataclass(frozen=True)
class TurboQuantTables:
    """What a TurboQuant layer's writers and readers share, fp32 on the CPU: ``rotation`` the
    normalized Sylvester Hadamard ``[D, D]`` (symmetric and orthonormal: both upstream's ``Pi``
    and ``PiT``), the Lloyd-Max ``centroids`` ``[2**centroid_bits]`` of ``N(0, 1/D)`` and the
    ``midpoints`` between the sorted centroids (the store's decision boundaries)."""

    rotation: torch.Tensor
    centroids: torch.Tensor
    midpoints: torch.Tensor


def turboquant_tables(head_size: int, centroid_bits: int) -> TurboQuantTables:
    """The tables of heads of ``head_size`` (a power of two) with ``centroid_bits``-bit codes
    (``TurboQuantConfig.centroid_bits``)."""
    centroids = get_centroids(head_size, centroid_bits).to(torch.float32)
    ordered = centroids.sort().values
    return TurboQuantTables(
        hadamard_matrix(head_size, torch.device("cpu")),
        centroids,
        (ordered[:-1] + ordered[1:]) / 2,
    )
