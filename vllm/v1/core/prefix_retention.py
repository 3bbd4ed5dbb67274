"""Sparse prefix-cache retention (upstream v0.33): which positions of a prompt keep a cached
state so a later request can resume there.

Sliding-window and Mamba groups need only a few pages (or one state) before a hit boundary,
so publishing every boundary costs pages that are rarely hit. ``retention_interval`` (tokens):
None publishes every boundary (dense); 0 only the replay boundaries; a positive multiple of
the scheduler block size one boundary per interval, plus the replay boundaries.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec, SlidingWindowSpec


def check_retention_interval(retention_interval: int | None, scheduler_block_size: int) -> None:
    """``ValueError`` unless ``retention_interval`` is None or a multiple >= 0 of
    ``scheduler_block_size`` (tokens)."""
    if retention_interval is None:
        return
    if (
        isinstance(retention_interval, bool)
        or not isinstance(retention_interval, int)
        or retention_interval < 0
        or retention_interval % scheduler_block_size
    ):
        raise ValueError(
            "retention_interval: expected None or a non-negative multiple of "
            f"scheduler_block_size {scheduler_block_size} (tokens), got {retention_interval!r}"
        )


def check_config_retention_interval(
    kv_cache_config: KVCacheConfig, scheduler_block_size: int
) -> int | None:
    """The config's ``prefix_cache_retention_interval``, checked: a positive one needs a
    sliding-window or Mamba group (the only kinds it thins)."""
    interval = kv_cache_config.prefix_cache_retention_interval
    if interval is None:
        return None
    sparse_kinds = (SlidingWindowSpec, MambaSpec)
    if interval != 0 and not any(
        isinstance(g.kv_cache_spec, sparse_kinds) for g in kv_cache_config.kv_cache_groups
    ):
        raise ValueError(
            "prefix_cache_retention_interval: expected 0 or None when the model has no "
            f"sliding-window or Mamba groups (it thins only those), got {interval}"
        )
    check_retention_interval(interval, scheduler_block_size)
    return interval


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at. A resend of the
    same prompt stops one token short (its last token is recomputed for the logits). With
    EAGLE a hit drops its last scheduler block, and a longer prompt can also reach the last
    whole block: both positions are kept (they differ only for a block-aligned prompt)."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))
