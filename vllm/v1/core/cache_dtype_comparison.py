"""One model's KV cache under several cache dtypes, side by side (what ``vllm-kv plan`` shows).

For each dtype: the per-layer specs, their :class:`~vllm.v1.core.kv_bytes.KVFootprint` and, for
a memory budget, the :class:`~vllm.v1.core.kv_cache_utils.KVCachePlan`. A budget too small for
one request gives a plan whose ``fits`` is False rather than an error, so the dtypes can still
be compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm.v1.core.kv_bytes import KVFootprint, kv_footprint
from vllm.v1.core.kv_cache_utils import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KVCachePlan,
    plan_kv_cache_for_specs,
)
from vllm.v1.core.model_layout import ModelLayout
from vllm.v1.core.model_specs import ModelKVSpecs, build_kv_cache_specs

__all__ = ["CacheDtypePlan", "compare_cache_dtypes"]


@dataclass(frozen=True)
class CacheDtypePlan:
    """One cache dtype of a comparison: its specs, and its plan when a budget was given."""

    dtype: str
    specs: ModelKVSpecs
    plan: KVCachePlan | None = None

    @property
    def footprint(self) -> KVFootprint:
        """Bytes per token and per sequence of the specs (no pages, no padding)."""
        return kv_footprint(self.specs.specs)


def compare_cache_dtypes(
    model: str,
    layout: ModelLayout,
    dtypes: Sequence[str],
    block_size: int | None = None,
    skip_layers: Iterable[str] = (),
    available_memory: int | None = None,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> list[CacheDtypePlan]:
    """``layout`` cached as each of ``dtypes`` (pages of ``block_size`` tokens, default the
    model's; ``skip_layers`` kept in the model dtype), planned for ``available_memory`` bytes
    per rank when given. ``max_model_len`` defaults to the config's
    ``max_position_embeddings``; ``ValueError`` when a budget is given and neither exists."""
    skip = list(skip_layers)
    specs = [build_kv_cache_specs(layout, dtype, block_size, skip) for dtype in dtypes]
    if available_memory is None:
        return [CacheDtypePlan(dtype=d, specs=s) for d, s in zip(dtypes, specs, strict=True)]
    max_model_len = max_model_len or layout.max_position_embeddings
    if max_model_len is None:
        raise ValueError("max_model_len: the config has no max_position_embeddings")
    return [
        CacheDtypePlan(
            dtype=dtype,
            specs=dtype_specs,
            plan=plan_kv_cache_for_specs(
                model,
                dtype_specs,
                available_memory,
                max_model_len,
                max_num_batched_tokens,
                require_fit=False,
            ),
        )
        for dtype, dtype_specs in zip(dtypes, specs, strict=True)
    ]
