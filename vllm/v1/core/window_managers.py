"""Single-type managers of the window specs (:mod:`vllm.v1.kv_cache_window_specs`).

* :class:`RSWAManager`: full attention over the prompt plus the last ``rswa_window`` generated
  tokens. Given the prompt length, pages wholly between the prompt's end and the start of that
  window are returned to the pool while the request decodes.
* :class:`CircularBufferManager`: one page per request for its whole lifetime, used as a ring;
  it is never published, never a prefix hit and never zeroed (a request reads only slots it
  wrote).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.attention_managers import FullAttentionManager
from vllm.v1.core.block_hashing import BlockHashList
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.prefix_retention import check_retention_interval
from vllm.v1.core.single_type_manager_base import expect_spec
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheSpec, RSWASpec
from vllm.v1.request import Request


class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention (see the module docstring)."""

    def __init__(self, kv_cache_spec: RSWASpec, **kwargs: Any) -> None:
        expect_spec(kv_cache_spec, (RSWASpec,), type(self).__name__)
        super().__init__(kv_cache_spec, **kwargs)
        self.rswa_window = kv_cache_spec.rswa_window

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free the pages wholly inside ``[num_prompt_tokens, processed_computed_tokens -
        rswa_window)`` (tokens); without ``num_prompt_tokens`` the gap is unknown and every page
        stays (as full attention)."""
        if num_prompt_tokens is None:
            super().remove_skipped_blocks(request_id, processed_computed_tokens)
            return
        window_start = max(num_prompt_tokens, processed_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(
            request_id, cdiv(num_prompt_tokens, self.block_size), window_start // self.block_size
        )


class CircularBufferManager(FullAttentionManager):
    """One ring page per request (see the module docstring)."""

    def __init__(self, kv_cache_spec: CircularBufferSpec, **kwargs: Any) -> None:
        expect_spec(kv_cache_spec, (CircularBufferSpec,), type(self).__name__)
        super().__init__(kv_cache_spec, **kwargs)

    def _claim_ring_block(self, request_id: str) -> list[KVCacheBlock]:
        """The request's ring page on its first call, then nothing."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        if req_blocks:
            return []
        req_blocks.extend(self.block_pool.get_new_blocks(1))
        return list(req_blocks)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """1 until the request holds its ring page, then 0 (hits are never taken)."""
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        return self._claim_ring_block(request_id)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Nothing to take: a ring is never a prefix hit."""

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """The ring page; connector tokens need no more (and it is never zeroed)."""
        self._claim_ring_block(request_id)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Never a hit."""
        expect_spec(kv_cache_spec, (CircularBufferSpec,), cls.__name__)
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
        alignment_tokens: int | None = None,
    ) -> None:
        """Nothing is published (the spec is not prefix-cacheable)."""
        check_retention_interval(retention_interval, self.scheduler_block_size)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """The ring is kept until the request ends."""

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0  # every request has its own ring


__all__ = ["CircularBufferManager", "RSWAManager"]
