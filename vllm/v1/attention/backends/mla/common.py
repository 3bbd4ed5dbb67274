"""``MLACommonBackend``: the cache shape of MLA (latent) layers; no forward pass here.

An MLA cache stores one latent per stored slot, shared by all heads: logical shape
``(num_blocks, block_size, head_size)`` in the storage dtype, or, for a record layout,
``(num_blocks, block_size, record bytes)`` (uint8): ``fp8_ds_mla`` 656 bytes for head size 576
(584 for DeepSeek-V4's 512), ``nvfp4_ds_mla`` 352 bytes for head size 576. For compressed specs
(DeepSeek-V4) ``block_size`` here is the storage block size (slots per page). The writer of
every format is :func:`vllm._custom_ops.concat_and_cache_mla`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.kv_quant.ds_mla_nvfp4 import NVFP4_DS_MLA
from vllm.kv_quant.formats import (
    AUTO,
    BFLOAT16,
    FLOAT16,
    FP8_DS_MLA,
    FP8_E4M3,
    accepted_names_of,
    lookup,
)
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    MultipleOf,
    check_kv_cache_shape_args,
)


class MLACommonBackend(AttentionBackend):
    """Shapes of MLA caches: ``(num_blocks, block_size, head_size or record bytes)``."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = accepted_names_of(
        AUTO, FLOAT16, BFLOAT16, FP8_E4M3, FP8_DS_MLA, NVFP4_DS_MLA
    )
    supported_kernel_block_sizes: ClassVar[list[int | MultipleOf]] = [MultipleOf(1)]
    is_mla: ClassVar[bool] = True

    @staticmethod
    def get_name() -> str:
        return "MLA_COMMON"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, block_size, row)``: one latent head, ``row`` the format's last dim
        (a record's bytes: ``fp8_ds_mla`` 656 / 584, ``nvfp4_ds_mla`` 352; else
        ``head_size``)."""
        check_kv_cache_shape_args(
            "MLACommonBackend", num_blocks, block_size, num_kv_heads, head_size
        )
        if num_kv_heads != 1:
            raise ValueError(
                f"num_kv_heads: an MLA cache holds one latent per slot (1 KV head), "
                f"got {num_kv_heads}"
            )
        row = lookup(cache_dtype_str, "cache_dtype_str").last_dim(head_size)
        return (num_blocks, block_size, row)

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...]:
        """MLA caches have no head dim; the layout setting does not apply."""
        return (0, 1, 2)
