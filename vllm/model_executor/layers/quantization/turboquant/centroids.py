"""Upstream's ``turboquant.centroids`` path for :mod:`vllm.kv_quant.turboquant.centroids`."""

from vllm.kv_quant.turboquant.centroids import get_centroids, solve_lloyd_max

__all__ = ["get_centroids", "solve_lloyd_max"]
