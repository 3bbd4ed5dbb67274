"""Helpers for the KVCacheManager tests: requests, small configs, and a tiny scheduler that
drives a manager (prefix lookup, chunked prefill, decode, preemption) while recording what each
page would hold, so tests can check hits, reference counts and leaks."""

from __future__ import annotations

from collections import Counter

import torch

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

init_none_hash(sha256)


def make_request(rid: str, tokens: list[int], hash_block_size: int) -> Request:
    """A text request hashed every ``hash_block_size`` tokens."""
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1 << 20),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def sliding(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=window,
    )


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        attention_chunk_size=chunk,
    )


def mamba(block_size: int, mode: str = "none") -> MambaSpec:
    return MambaSpec(
        block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode=mode
    )


def config_of(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    """One group (of one layer) per spec; no tensors (the manager only reads the groups)."""
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


class ManagerSim:
    """Schedules requests on a :class:`KVCacheManager` one call at a time.

    ``contents[block_id]`` is the token prefix the page's data derives from (a model's K/V or
    state at a position depends on every token before it), written when a request computes
    tokens of that page; a prefix hit must return pages whose contents equal the request's own
    prefix."""

    def __init__(self, manager: KVCacheManager, chunk: int) -> None:
        self.manager = manager
        self.chunk = chunk
        self.block_sizes = [
            g.kv_cache_spec.block_size for g in manager.kv_cache_config.kv_cache_groups
        ]
        self.running: dict[str, Request] = {}
        # request id -> computed tokens when its pages were last allocated
        self.last_start: dict[str, int] = {}
        self.contents: dict[int, tuple[int, ...]] = {}
        self.num_hit_tokens = 0
        # The last prefix lookup: (pages per group, tokens).
        self.last_hit: tuple[KVCacheBlocks, int] | None = None

    def schedule(
        self, request: Request, next_token: int = 0, lookahead: int = 0, external: int = 0
    ) -> bool:
        """One step of ``request`` (prefix lookup first when it is not running): up to
        ``chunk`` tokens are computed (with ``lookahead`` extra speculative slots), and a
        sampled ``next_token`` is appended once the prompt is done. A request that is not
        running may also get up to ``external`` tokens after its prefix hit from a connector
        (their K/V arrive computed). False when the pool is short: then nothing was taken (see
        :meth:`check_nothing_taken`)."""
        hit_tokens, hit_blocks, num_external = 0, None, 0
        if request.request_id not in self.running:
            hit_blocks, hit_tokens, _ = self.manager.get_computed_blocks(request)
            self.check_hit(request, hit_blocks, hit_tokens)
            self.last_hit = (hit_blocks, hit_tokens)
            num_external = min(external, request.num_tokens - hit_tokens)
        start = request.num_computed_tokens + hit_tokens
        num_new = min(self.chunk, request.num_tokens - start - num_external)
        before = self.snapshot(request.request_id)
        if (
            self.manager.allocate_slots(
                request,
                num_new,
                hit_tokens,
                hit_blocks,
                num_lookahead_tokens=lookahead,
                num_external_computed_tokens=num_external,
            )
            is None
        ):
            self.check_nothing_taken(request.request_id, before)
            return False
        self.running[request.request_id] = request
        self.num_hit_tokens += hit_tokens
        end = start + num_external + num_new
        self.last_start[request.request_id] = start + num_external
        self._compute(request, start, end)
        request.num_computed_tokens = end
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(next_token)
        return True

    def snapshot(self, request_id: str) -> tuple[int, dict[int, int], list[list[int]]]:
        """The free count, every page's reference count and the request's block tables."""
        pool = self.manager.block_pool
        tables = [
            [b.block_id for b in single.req_to_blocks.get(request_id, ())]
            for single in self.manager.coordinator.single_type_managers
        ]
        return pool.get_num_free_blocks(), {b.block_id: b.ref_cnt for b in pool.blocks}, tables

    def check_nothing_taken(
        self, request_id: str, before: tuple[int, dict[int, int], list[list[int]]]
    ) -> None:
        """A refused allocation took no page: the request's tables only lost pages that left
        its window (replaced by the null page, freed before the check), no other page's
        reference count changed, and the free count did not fall."""
        free_before, refs_before, tables_before = before
        free_after, refs_after, tables_after = self.snapshot(request_id)
        assert free_after >= free_before, "a refused allocation took free pages"
        null_id = self.manager.block_pool.null_block.block_id
        left_window = set()
        for old, new in zip(tables_before, tables_after, strict=True):
            assert len(new) == len(old), "a refused allocation changed a block table's length"
            for old_id, new_id in zip(old, new, strict=True):
                assert new_id in (old_id, null_id), "a refused allocation replaced a page"
                if new_id != old_id:
                    left_window.add(old_id)
        for block_id, ref_cnt in refs_before.items():
            if block_id not in left_window and block_id != null_id:
                assert refs_after[block_id] == ref_cnt, f"page {block_id} changed owners"

    def _compute(self, request: Request, start: int, end: int) -> None:
        tokens = tuple(request.all_token_ids)
        tables = self.manager.get_blocks(request.request_id).blocks
        for table, block_size in zip(tables, self.block_sizes, strict=True):
            for j in range(start // block_size, cdiv(end, block_size)):
                block = table[j]
                if not block.is_null:
                    self.contents[block.block_id] = tokens[: min((j + 1) * block_size, end)]

    def check_hit(self, request: Request, hit: KVCacheBlocks, num_tokens: int) -> None:
        """Every non-null hit page holds exactly the request's prefix up to its end, and each
        group's hit covers ``num_tokens`` tokens (never the whole request)."""
        assert 0 <= num_tokens < max(request.num_tokens, 1)
        tokens = tuple(request.all_token_ids)
        if num_tokens == 0:
            return
        for blocks, block_size in zip(hit.blocks, self.block_sizes, strict=True):
            assert len(blocks) * block_size == num_tokens
            for j, block in enumerate(blocks):
                if not block.is_null:
                    assert self.contents[block.block_id] == tokens[: (j + 1) * block_size]

    def preempt(self, request: Request) -> None:
        """Free the request's pages; it restarts from its prefix-cache hits later."""
        self.manager.free(request)
        del self.running[request.request_id]
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def finish(self, request: Request) -> None:
        self.manager.free(request)
        self.running.pop(request.request_id, None)

    def check_invariants(self) -> None:
        """No page in two groups or twice in one table, reference counts equal the tables
        holding a page, the free count is everything else (the null page aside)."""
        pool = self.manager.block_pool
        refs: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        coordinator = self.manager.coordinator
        for g, single in enumerate(coordinator.single_type_managers):
            for rid, table in single.req_to_blocks.items():
                ids = [b.block_id for b in table if not b.is_null]
                assert len(ids) == len(set(ids)), f"request {rid} holds a page twice"
                for block_id in ids:
                    assert group_of.setdefault(block_id, g) == g, "a page in two groups"
                refs.update(ids)
        for block in pool.blocks:
            if not block.is_null:
                assert block.ref_cnt == refs[block.block_id], block
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - len(refs)
        for single in coordinator.single_type_managers:
            if isinstance(single, (SlidingWindowManager, ChunkedLocalAttentionManager)):
                # Pages that left the window (or finished chunks) were returned when the last
                # chunk was allocated.
                for rid in self.running:
                    skipped = single.get_num_skipped_tokens(self.last_start[rid])
                    table = single.req_to_blocks[rid]
                    assert all(b.is_null for b in table[: skipped // single.block_size])

    def free_all_and_check_no_leak(self) -> None:
        for request in list(self.running.values()):
            self.finish(request)
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
        for single in self.manager.coordinator.single_type_managers:
            assert not single.req_to_blocks and not single.num_cached_block
