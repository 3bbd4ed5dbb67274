"""TurboQuant KV-cache formats (upstream v0.33.0): Hadamard-rotated keys coded by a Lloyd-Max
scalar quantizer (or FP8 keys), uniform value codes, per-token norms, K and V packed in one
slot per (token, KV head). Presets and sizes in :mod:`.config`, the quantizer tables in
:mod:`.centroids`, the reference bytes in :mod:`.codec`, the registry entries in :mod:`.formats`.
"""

from vllm.kv_quant.turboquant.centroids import get_centroids, solve_lloyd_max
from vllm.kv_quant.turboquant.codec import (
    rotate_unit_keys,
    turboquant_decode_slots,
    turboquant_encode_slots,
    turboquant_read_cache,
    turboquant_write_cache,
)
from vllm.kv_quant.turboquant.config import TQ_PRESETS, TURBOQUANT_MODES, TurboQuantConfig
from vllm.kv_quant.turboquant.formats import TURBOQUANT_FORMATS

__all__ = [
    "TQ_PRESETS",
    "TURBOQUANT_FORMATS",
    "TURBOQUANT_MODES",
    "TurboQuantConfig",
    "get_centroids",
    "rotate_unit_keys",
    "solve_lloyd_max",
    "turboquant_decode_slots",
    "turboquant_encode_slots",
    "turboquant_read_cache",
    "turboquant_write_cache",
]
