"""Torch dtype maps and NVFP4 cache-layout utilities."""

from __future__ import annotations

import torch

STR_DTYPE_TO_TORCH_DTYPE: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.uint8,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
    "nvfp4": torch.uint8,
}
"""Storage dtype of each ``kv_cache_dtype`` string (``auto`` is resolved against the model)."""

MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP: dict[str, str] = {
    "fp8": "fp8_e4m3",
    "nvfp4": "nvfp4",
}
"""ModelOpt ``kv_cache_quant_algo`` names (lower-cased) to our ``kv_cache_dtype`` strings."""

NVFP4_GROUP_SIZE = 16
"""Elements sharing one FP8-e4m3 block scale."""


def get_dtype_size(dtype: torch.dtype) -> int:
    """Size of one element of ``dtype`` in bytes."""
    return torch.tensor([], dtype=dtype).element_size()


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """True for the FP8 and NVFP4 cache dtype strings."""
    return kv_cache_dtype.startswith("fp8") or kv_cache_dtype == "nvfp4"


def kv_cache_dtype_str_to_dtype(
    kv_cache_dtype: str, model_dtype: str | torch.dtype | None
) -> torch.dtype:
    """Storage dtype for ``kv_cache_dtype``; ``auto`` resolves to ``model_dtype``."""
    if kv_cache_dtype == "auto":
        if isinstance(model_dtype, torch.dtype):
            return model_dtype
        if isinstance(model_dtype, str) and model_dtype in STR_DTYPE_TO_TORCH_DTYPE:
            return STR_DTYPE_TO_TORCH_DTYPE[model_dtype]
        raise ValueError(
            f"model_dtype: kv_cache_dtype='auto' needs the model dtype as a torch.dtype or one "
            f"of {', '.join(STR_DTYPE_TO_TORCH_DTYPE)}, got {model_dtype!r}"
        )
    if kv_cache_dtype not in STR_DTYPE_TO_TORCH_DTYPE:
        raise ValueError(
            f"kv_cache_dtype: unknown KV-cache dtype {kv_cache_dtype!r}; expected 'auto' or one "
            f"of {', '.join(STR_DTYPE_TO_TORCH_DTYPE)}"
        )
    return STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype]


def nvfp4_kv_cache_full_dim(head_size: int) -> int:
    """Packed NVFP4 bytes per head per side: ``D/2`` data bytes plus ``D/16`` scale bytes."""
    if head_size <= 0 or head_size % NVFP4_GROUP_SIZE != 0:
        raise ValueError(
            f"head_size: NVFP4 KV cache needs a positive multiple of {NVFP4_GROUP_SIZE}, "
            f"got {head_size}"
        )
    return head_size // 2 + head_size // NVFP4_GROUP_SIZE


def _nvfp4_data_dim(full_dim: int) -> int:
    """Data bytes of a packed last dim ``F = 9 * D / 16``; raises for an F no head size gives."""
    if full_dim <= 0 or full_dim % 9 != 0:
        raise ValueError(
            f"kv_cache: last dim {full_dim} is not a packed NVFP4 head dim F(D) = D/2 + D/16 "
            "for a head size D that is a multiple of 16 (expected a positive multiple of 9)"
        )
    return full_dim * 8 // 9


def _nvfp4_split_data_scale(side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one side ``(B, d1, d2, F)`` of a packed NVFP4 cache into data and scale views.

    Each page of the side holds ``d1*d2*data_dim`` data bytes followed by ``d1*d2*scale_dim``
    scale bytes, in the order the side's strides give (NHD or HND). Both views share storage
    with ``side``; the scale view is ``float8_e4m3fn``.
    """
    if side.dim() != 4:
        raise ValueError(
            f"kv_cache: expected a 4-D side (B, d1, d2, F), got shape {tuple(side.shape)}"
        )
    if side.dtype != torch.uint8:
        raise ValueError(f"kv_cache: expected dtype torch.uint8 for NVFP4, got {side.dtype}")
    num_blocks, d1, d2, full_dim = side.shape
    page_stride, s1, s2, s3 = side.stride()
    data_dim = _nvfp4_data_dim(full_dim)
    scale_dim = full_dim - data_dim
    is_nhd = (d1 == 1 or s1 == d2 * full_dim) and (d2 == 1 or s2 == full_dim)
    is_hnd = (d1 == 1 or s1 == full_dim) and (d2 == 1 or s2 == d1 * full_dim)
    if s3 != 1 or not (is_nhd or is_hnd):
        raise ValueError(
            "kv_cache: each page of an NVFP4 cache side must be one dense region; expected "
            f"strides (*, {d2 * full_dim}, {full_dim}, 1) (NHD) or (*, {full_dim}, "
            f"{d1 * full_dim}, 1) (HND), got {side.stride()}"
        )
    offset = side.storage_offset()
    data = side.as_strided(
        (num_blocks, d1, d2, data_dim),
        (page_stride, s1 * data_dim // full_dim, s2 * data_dim // full_dim, 1),
        offset,
    )
    scale = side.as_strided(
        (num_blocks, d1, d2, scale_dim),
        (page_stride, s1 * scale_dim // full_dim, s2 * scale_dim // full_dim, 1),
        offset + d1 * d2 * data_dim,
    ).view(torch.float8_e4m3fn)
    return data, scale


def nvfp4_kv_cache_split_views(
    kv_cache: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Data and scale views of a packed NVFP4 cache, as upstream vLLM returns them.

    A 5-D cache ``(B, 2, N, H, F)`` gives ``((k_data, v_data), (k_scale, v_scale))``; a 4-D
    side ``(B, N, H, F)`` gives one-element tuples ``((data,), (scale,))``, so that
    ``(data,), (scale,) = nvfp4_kv_cache_split_views(key_cache)`` unpacks it. Data views are
    uint8 ``(B, N, H, D/2)``, scale views float8_e4m3fn ``(B, N, H, D/16)``; NHD and HND are
    read from the strides and kept.
    """
    if kv_cache.dim() == 4:
        data, scale = _nvfp4_split_data_scale(kv_cache)
        return (data,), (scale,)
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2:
        k_data, k_scale = _nvfp4_split_data_scale(kv_cache[:, 0])
        v_data, v_scale = _nvfp4_split_data_scale(kv_cache[:, 1])
        return (k_data, v_data), (k_scale, v_scale)
    raise ValueError(
        "kv_cache: expected a 4-D side (B, N, H, F) or a 5-D cache (B, 2, N, H, F), "
        f"got shape {tuple(kv_cache.shape)}"
    )
