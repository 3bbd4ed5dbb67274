"""Coordinators: one block pool and one single-type manager per KV cache group, driven together.

Every group of a model sees the same token sequence, so allocation, freeing and publishing are
fanned out to all managers. Prefix lookup differs:

* :class:`KVCacheCoordinatorNoPrefixCache`: no lookup (prefix caching off), any number of groups;
* :class:`UnitaryKVCacheCoordinator`: one group, its manager's lookup;
* :class:`HybridKVCacheCoordinator`: several groups of different kinds and page sizes. A hit
  must be usable by every group at one length, a multiple of the LCM of the groups' pages; the
  lookup shrinks a candidate length until every kind accepts it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from math import lcm
from typing import TYPE_CHECKING, Any

from vllm.v1.core.block_hashing import BlockHash
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.hybrid_cache_lookup import HybridCacheLookup
from vllm.v1.core.hybrid_cache_lookup import SpecGroup as SpecGroup  # v0.33 exports it here
from vllm.v1.core.kv_cache_block import KVCacheBlock
from vllm.v1.core.prefix_retention import check_config_retention_interval, replay_boundaries
from vllm.v1.core.single_type_kv_cache_manager import (
    CrossAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector


class KVCacheCoordinator(ABC):
    """The block pool of ``kv_cache_config.num_blocks`` pages and the managers of its groups.

    ``max_model_len`` / ``max_in_flight_tokens`` (tokens scheduled but not yet settled) in tokens;
    ``hash_block_size``: the tokens per block hash of requests (every group's block size is a
    multiple of it); ``scheduler_block_size``: the scheduling granularity (tokens, a multiple of
    every group's block size; None: their LCM). ``num_prefill_lookahead`` (tokens; multi-module
    MTP's speculative tokens): the last ``num_prefill_lookahead - 1`` computed tokens may be
    re-prefilled, so they are never published. ``num_hash_lookahead_tokens`` (tokens): the
    tokens after each block that the requests' block hashes also cover."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
        scheduler_block_size: int | None = None,
        num_prefill_lookahead: int = 0,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        if isinstance(num_hash_lookahead_tokens, bool):
            num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)  # upstream passes flags
        if not isinstance(num_hash_lookahead_tokens, int) or num_hash_lookahead_tokens < 0:
            raise ValueError(
                "num_hash_lookahead_tokens: expected an int >= 0 (tokens), "
                f"got {num_hash_lookahead_tokens!r}"
            )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self._check_config()
        self.block_pool = BlockPool(
            num_gpu_blocks=kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=metrics_collector,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
        groups = kv_cache_config.kv_cache_groups
        self.scheduler_block_size = self._scheduler_block_size(scheduler_block_size)
        if isinstance(num_prefill_lookahead, bool) or not isinstance(num_prefill_lookahead, int):
            raise TypeError(
                f"num_prefill_lookahead: expected an int (tokens), got {num_prefill_lookahead!r}"
            )
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        # See vllm.v1.core.prefix_retention (None: dense).
        self.retention_interval = (
            None
            if self.scheduler_block_size is None
            else check_config_retention_interval(kv_cache_config, self.scheduler_block_size)
        )
        # Groups whose hits drop the last page for the EAGLE drafter; when the config marks
        # none but EAGLE is on, every group does (the safe choice).
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        # Only an EAGLE engine drops: with lookahead hashes (use_eagle off) a hash already
        # proves the tokens the drafter reads past its block, so flagged groups keep it.
        self.drop_eagle_group_ids = self.eagle_group_ids if use_eagle else set()
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                kv_cache_spec=group.kv_cache_spec,
                role=group.role,
                max_in_flight_tokens=max_in_flight_tokens,
                max_model_len=max_model_len,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
                scheduler_block_size=self.scheduler_block_size,
                dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size,
                needs_kv_cache_zeroing=kv_cache_config.needs_kv_cache_zeroing,
            )
            for i, group in enumerate(groups)
        )
        # Tokens per page of each group, context parallelism included.
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        for i, manager in enumerate(self.single_type_managers):
            manager.use_eagle = i in self.drop_eagle_group_ids
            if isinstance(manager, MambaManager):
                # Checkpoints sit where EAGLE's attention hits end: one hash block lower.
                manager.drop_eagle_checkpoint_block = use_eagle
        # With EAGLE the dropped hit tail must hold every prefill lookahead token, and hits
        # end on scheduler-block boundaries.
        if (
            enable_caching
            and self.eagle_group_ids
            and self.scheduler_block_size is not None
            and self.scheduler_block_size < num_prefill_lookahead
        ):
            raise ValueError(
                f"scheduler_block_size: multi-module MTP with prefix caching expected >= "
                f"num_prefill_lookahead {num_prefill_lookahead} (tokens), got "
                f"{self.scheduler_block_size}"
            )
        self._init_lookup()

    def _scheduler_block_size(self, requested: int | None) -> int | None:
        """``requested``, checked to be a multiple of every group's page (tokens, context
        parallelism included); None: their LCM (None without groups)."""
        groups = self.kv_cache_config.kv_cache_groups
        if not groups:
            return requested
        # A sharded group's page spans the context-parallel ranks' tokens.
        scale = self.dcp_world_size  # PCP splits steps, not pages
        specs = [g.kv_cache_spec for g in groups]
        unit = lcm(*(s.block_size * (scale if s.dcp_sharded else 1) for s in specs))
        if requested is None:
            return unit
        if isinstance(requested, bool) or not isinstance(requested, int) or requested % unit:
            raise ValueError(
                f"scheduler_block_size: expected a multiple of {unit} (the groups' block sizes' "
                f"LCM, tokens), got {requested!r}"
            )
        return requested

    def _check_config(self) -> None:
        """Refuse a config this coordinator cannot serve and note what its lookup reads (runs
        before the pool and the managers are built)."""
        return None

    def _init_lookup(self) -> None:
        """Prepare the prefix lookup once the managers exist."""
        return None

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Free pages all groups together would consume (see the managers' method);
        cross-attention groups size by ``num_encoder_tokens`` and take no hits.
        ``prefill_end`` (tokens): where the request's prefill ends; only sparse retention
        (interval 0) keeps a Mamba prefill checkpoint to the chunk reaching it, dense
        retention publishes one every chunk."""
        if self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            cross = isinstance(manager, CrossAttentionManager)
            total += manager.get_num_blocks_to_allocate(
                request_id,
                num_encoder_tokens if cross else num_tokens,
                [] if cross else new_computed_blocks[i],
                0 if cross else total_computed_tokens,
                0 if cross else num_local_computed_tokens,
                num_encoder_tokens if cross else num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
                prefill_end=0 if cross else prefill_end,
            )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> None:
        """Hand each group its prefix-hit pages, then pages for connector tokens (if any;
        ``skip_zeroing_group_ids``: groups whose connector pages an async load writes, so they
        are not listed for zeroing). Every group's hits are referenced before any group takes
        fresh pages: a fresh page may be an unreferenced cached one, and evicting another
        group's hit would put one page in two groups."""
        managers = self.single_type_managers
        if any(request_id in manager.num_cached_block for manager in managers):
            assert not any(new_computed_blocks), "a running request cannot take new prefix hits"
            return
        for manager, blocks in zip(managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(
                request_id, blocks, num_local_computed_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        for group_id, manager in enumerate(managers):
            manager.allocate_external_computed_blocks(
                request_id,
                num_local_computed_tokens,
                num_external_computed_tokens,
                record_for_zeroing=group_id not in skip_zeroing_group_ids,
            )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Fresh pages per group so the request has ``num_tokens`` slots (cross-attention:
        ``num_encoder_tokens``)."""
        return tuple(
            manager.allocate_new_blocks(
                request_id,
                num_encoder_tokens if isinstance(manager, CrossAttentionManager) else num_tokens,
                num_tokens_main_model,
            )
            for manager in self.single_type_managers
        )

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Leading tokens whose K/V is final in group ``kv_cache_group_id`` (those a
        multi-module MTP step may re-prefill left out)."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def _replay_boundaries(self, request: Request) -> tuple[int, ...]:
        assert self.scheduler_block_size is not None  # a manager exists, so a group does
        return replay_boundaries(
            request.num_prompt_tokens, self.scheduler_block_size, bool(self.drop_eagle_group_ids)
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the full pages among the first ``num_computed_tokens`` tokens (sparsely
        for sliding-window groups under a retention interval)."""
        boundaries = self._replay_boundaries(request)
        for i, manager in enumerate(self.single_type_managers):
            manager.cache_blocks(
                request,
                self.get_num_cacheable_tokens(num_computed_tokens, i),
                self.retention_interval,
                replay_boundaries=boundaries,
            )

    def emit_cached_block_events(
        self, request: Request, computed_blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> None:
        """Queue BlockStored events for each group's hit pages, in that group's pool."""
        groups = self.kv_cache_config.kv_cache_groups
        for group_id, group_blocks in enumerate(computed_blocks):
            if group_blocks:
                self.single_type_managers[group_id].block_pool.emit_cached_block_events(
                    request, len(group_blocks), groups[group_id].kv_cache_spec.block_size, group_id
                )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix in each pool the groups use (each pool once); False
        when a pool still has pages in use."""
        pools = dict.fromkeys(m.block_pool for m in self.single_type_managers)
        pools.setdefault(self.block_pool)
        return all([pool.reset_prefix_cache() for pool in pools])

    def free(self, request_id: str) -> None:
        """Release the request's pages in every group."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request in every group and return its pages, group after group, without
        freeing them (the caller frees them)."""
        return [b for m in self.single_type_managers for b in m.pop_blocks_for_free(request_id)]

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading pages every request holding pages shares."""
        return [
            m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers
        ]

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free, in every group, the pages no later token reads (``num_prompt_tokens``: for
        kinds that free a middle range, R-SWA)."""
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's pages, per group (empty lists for an unknown request)."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """Hit pages per group, the hit length in tokens (at most ``max_cache_hit_length``) and
        the uncached common prefix (tokens): how far past the hit some group's own hit went,
        a shared prefix that a lagging group (Mamba, a window) has not cached yet; 0 with one
        group."""

    def new_step_starts(self) -> None:
        """Tell every manager a scheduler step begins."""
        for manager in self.single_type_managers:
            manager.new_step_starts()


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off (or unsupported): any number of groups, zero included, never a hit."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_kv_cache_events: bool,
        **kwargs: Any,
    ) -> None:
        """As :class:`KVCacheCoordinator` (keyword arguments included), caching off."""
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            False,
            enable_kv_cache_events,
            **kwargs,
        )
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group (all layers of one kind): its manager answers the lookup."""

    def _check_config(self) -> None:
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        if num_groups != 1:
            raise ValueError(
                f"kv_cache_config: UnitaryKVCacheCoordinator expected 1 group, got {num_groups}"
            )
        self.kv_cache_spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        scale = self.dcp_world_size  # PCP splits steps, not pages
        self.block_size = self.kv_cache_spec.block_size * (
            scale if self.kv_cache_spec.dcp_sharded else 1
        )
        # Mamba-only models without prefix caching use one page per request
        # (block_size = max_model_len): the hash granularity is then irrelevant.
        if self.enable_caching and self.hash_block_size != self.block_size:
            raise ValueError(
                f"hash_block_size: expected the group's block_size {self.block_size} (tokens), "
                f"got {self.hash_block_size}"
            )

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        hit, hit_length = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_cache_hit_length,
            kv_cache_group_ids=[0],
            block_pool=self.single_type_managers[0].block_pool,
            kv_cache_spec=self.kv_cache_spec,
            drop_eagle_block=0 in self.drop_eagle_group_ids,
            alignment_tokens=self.block_size,
            dcp_world_size=self.dcp_world_size,
            pcp_world_size=self.pcp_world_size,
        )
        return hit, hit_length, 0  # one group: none lags another


class HybridKVCacheCoordinator(HybridCacheLookup, KVCacheCoordinator):
    """Several KV cache groups of different kinds; the lookup is in
    vllm.v1.core.hybrid_cache_lookup."""

    def _check_config(self) -> None:
        context_parallel = self.dcp_world_size * self.pcp_world_size > 1
        for i, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            # Sharded pages of another kind would split windows or states across ranks.
            if context_parallel and spec.dcp_sharded and not isinstance(spec, FullAttentionSpec):
                raise ValueError(
                    f"dcp_world_size, pcp_world_size: hybrid models with context parallelism "
                    f"expected full-attention or replicated groups, got {type(spec).__name__} "
                    f"(group {i}) at {self.dcp_world_size} and {self.pcp_world_size}"
                )
            # Groups that are never prefix-cached (rings, bounded-replay windows) are not hashed.
            if spec.prefix_cacheable and spec.block_size % self.hash_block_size:
                raise ValueError(
                    f"hash_block_size: expected a divisor of every prefix-cacheable group's "
                    f"block_size, got "
                    f"{self.hash_block_size} (group {i}: {group.kv_cache_spec.block_size})"
                )

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """Up to the last LCM segment boundary (hits are whole segments; no rounding with
        partial hash hits); an EAGLE group also its page past it, which a hit matches and then
        drops (tokens)."""
        finalized = super().get_num_cacheable_tokens(num_computed_tokens, kv_cache_group_id)
        manager = self.single_type_managers[kv_cache_group_id]
        if self.enable_partial_hash_hits:
            # Only EAGLE groups' last tokens may be re-prefilled by multi-module MTP.
            return finalized if manager.use_eagle else num_computed_tokens
        aligned = finalized // self.lcm_block_size * self.lcm_block_size
        if manager.use_eagle and aligned > 0:
            return min(finalized, aligned + manager.block_size)
        return aligned

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        boundaries = self._replay_boundaries(request)
        for i, manager in enumerate(self.single_type_managers):
            manager.cache_blocks(
                request,
                self.get_num_cacheable_tokens(num_computed_tokens, i),
                self.retention_interval,
                replay_boundaries=boundaries,
                alignment_tokens=self.lcm_block_size,
            )


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    hash_block_size: int,
    metrics_collector: KVCacheMetricsCollector | None = None,
    scheduler_block_size: int | None = None,
    num_prefill_lookahead: int = 0,
    num_hash_lookahead_tokens: int = 0,
) -> KVCacheCoordinator:
    """The coordinator for ``kv_cache_config``: no-prefix-cache when caching is off, unitary
    for one group, hybrid otherwise."""
    common: dict[str, Any] = dict(
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
        hash_block_size=hash_block_size,
        metrics_collector=metrics_collector,
        scheduler_block_size=scheduler_block_size,
        num_prefill_lookahead=num_prefill_lookahead,
        num_hash_lookahead_tokens=num_hash_lookahead_tokens,
    )
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_kv_cache_events,
            **common,
        )
    coordinator_cls: type[UnitaryKVCacheCoordinator | HybridKVCacheCoordinator] = (
        UnitaryKVCacheCoordinator
        if len(kv_cache_config.kv_cache_groups) == 1
        else HybridKVCacheCoordinator
    )
    return coordinator_cls(
        kv_cache_config,
        max_model_len,
        max_in_flight_tokens,
        use_eagle,
        enable_caching,
        enable_kv_cache_events,
        **common,
    )
