"""Pure-torch reference codecs for every KV-cache byte format (FP8, NVFP4, per-token-head INT8
and FP8, scale layouts), and the engines' calibration (:class:`KVCacheCalibrator` for a whole
encoding, :class:`KVScaleObserver` for the scales alone).

These functions are the single source of truth for the cache formats of docs/design.md §5: compiled
kernels (CPU and CUDA) are tested against them bit for bit. They run on the input's device.
"""

from vllm.kv_quant.calibration import KVScaleObserver, kv_scale_max, kv_scales_from_amax
from vllm.kv_quant.calibrator import KVCacheCalibrator
from vllm.kv_quant.ds_mla_nvfp4 import NVFP4_DS_MLA  # noqa: F401  (registers it)
from vllm.kv_quant.fp8 import (
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    FP8_NAN_BYTE,
    Fp8Format,
    as_fp8_format,
    dequantize_fp8,
    fp8_bytes_to_fp32,
    fp8_format_from_cache_dtype,
    fp32_to_fp8_bytes,
    quantize_fp8,
)
from vllm.kv_quant.fp8_cache import fp8_read_cache, fp8_write_cache
from vllm.kv_quant.hadamard import HADAMARD, check_hadamard_head_size, hadamard_rotate
from vllm.kv_quant.int4_per_token_head import INT4_PER_TOKEN_HEAD  # noqa: F401  (registers it)
from vllm.kv_quant.key_rope import KeyRope
from vllm.kv_quant.key_sinks import key_sink_scale, read_key_sinks, write_key_sinks
from vllm.kv_quant.key_transform import KeyTransform
from vllm.kv_quant.kv_scale import is_per_tensor_scale, kv_scale_as_1d
from vllm.kv_quant.nvfp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    NVFP4_GROUP_SIZE,
    NVFP4_SCALE_MAX,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_decode_table,
    e2m1_encode,
    fp32_to_e4m3_satfinite,
    pack_e2m1,
    quantize_nvfp4,
    unpack_e2m1,
)
from vllm.kv_quant.nvfp4_cache import nvfp4_read_cache, nvfp4_read_cache_raw, nvfp4_write_cache
from vllm.kv_quant.octave import OCTAVE_FORMATS  # noqa: F401  (registers them)
from vllm.kv_quant.per_token_head import (
    INT8_PER_TOKEN_HEAD_MAX,
    PER_TOKEN_HEAD_SCALE_FLOOR,
    dequantize_per_token_head,
    pack_rows,
    per_token_head_qmax,
    per_token_head_read_cache,
    per_token_head_write_cache,
    quantize_per_token_head,
    unpack_rows,
)
from vllm.kv_quant.scale_layout import (
    ScaleLayout,
    from_layout,
    interleave4_index,
    layout_index,
    to_layout,
)
from vllm.kv_quant.turboquant import TURBOQUANT_FORMATS  # noqa: F401  (registers the formats)
from vllm.kv_quant.ultraquant import ULTRAQUANT_4BIT  # noqa: F401  (registers it)

__all__ = [
    "HADAMARD",
    "KVCacheCalibrator",
    "KeyRope",
    "KeyTransform",
    "key_sink_scale",
    "read_key_sinks",
    "write_key_sinks",
    "check_hadamard_head_size",
    "hadamard_rotate",
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "FP8_E5M2_MAX",
    "FP8_NAN_BYTE",
    "INT8_PER_TOKEN_HEAD_MAX",
    "NVFP4_GROUP_SIZE",
    "NVFP4_SCALE_MAX",
    "PER_TOKEN_HEAD_SCALE_FLOOR",
    "Fp8Format",
    "KVScaleObserver",
    "ScaleLayout",
    "as_fp8_format",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "dequantize_per_token_head",
    "e2m1_decode",
    "e2m1_decode_table",
    "e2m1_encode",
    "fp8_bytes_to_fp32",
    "fp8_format_from_cache_dtype",
    "fp8_read_cache",
    "fp8_write_cache",
    "fp32_to_e4m3_satfinite",
    "fp32_to_fp8_bytes",
    "from_layout",
    "interleave4_index",
    "is_per_tensor_scale",
    "kv_scale_as_1d",
    "kv_scale_max",
    "kv_scales_from_amax",
    "layout_index",
    "nvfp4_read_cache",
    "nvfp4_read_cache_raw",
    "nvfp4_write_cache",
    "pack_e2m1",
    "pack_rows",
    "per_token_head_qmax",
    "per_token_head_read_cache",
    "per_token_head_write_cache",
    "quantize_fp8",
    "quantize_nvfp4",
    "quantize_per_token_head",
    "to_layout",
    "unpack_e2m1",
    "unpack_rows",
]
