"""Upstream v0.33.0's TurboQuant module path; the implementation is
:mod:`vllm.kv_quant.turboquant` (the bottom layer, which the format registry needs)."""

from vllm.kv_quant.turboquant.config import TurboQuantConfig

__all__ = ["TurboQuantConfig"]
