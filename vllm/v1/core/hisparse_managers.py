"""HiSparse's single-type managers (upstream exports them from
``vllm.v1.core.single_type_kv_cache_manager``).

A HiSparse model keeps three kinds of group: the *source* (the sparse layers' full history,
in a host pool: :class:`HiSparseSourceManager`), the *resident* pages (the newest pages of a
request on the device, plus older ones still pinned: :class:`HiSparseResidentManager`) and
the *hot* buffer (a fixed set of device pages holding what the indexer picked from the host:
:class:`HiSparseHotManager`). The source group owns prefix caching; the device groups never
publish or hit. A :class:`~vllm.v1.hisparse.coordinator.HiSparseCoordinator` binds itself to
all of them and decides residency.

Units: ``block_size`` and token counts are in tokens; page indices count ``block_size``
pages from the request's first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from vllm.distributed.kv_events import MEDIUM_CPU
from vllm.utils.math_utils import cdiv
from vllm.v1.core.attention_managers import FullAttentionManager
from vllm.v1.core.block_hashing import BlockHashList
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_block import KVCacheBlock, trim_null_head
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool
from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec, KVCacheSpec
from vllm.v1.request import Request


class HiSparseCoordinatorHooks(Protocol):
    """What the managers ask of the coordinator that binds them
    (:class:`vllm.v1.hisparse.coordinator.HiSparseCoordinator`, which sits above them)."""

    gpu_pool: BlockPool | None
    resident_managers: Sequence[SingleTypeKVCacheManager]

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None: ...

    def publish_when_ready(
        self,
        request: Request,
        num_computed_tokens: int,
        retention_interval: int | None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None: ...

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None: ...

    def free(self, request_id: str) -> None: ...


__all__ = ["HiSparseHotManager", "HiSparseResidentManager", "HiSparseSourceManager"]


def _bound(coordinator: HiSparseCoordinatorHooks | None) -> HiSparseCoordinatorHooks:
    if coordinator is None:
        raise ValueError(
            "coordinator: expected a HiSparseCoordinator bound to this manager "
            "(get_hisparse_coordinator), got None"
        )
    return coordinator


class HiSparseSourceManager(FullAttentionManager):
    """The host tier: full-attention bookkeeping over a private host pool.

    Every page a request holds has a host page, so any device copy can be written back and
    its device page reclaimed; admission fails when the host pool cannot back the request.
    Hashes are published only once the host copies are durable (the coordinator calls
    :meth:`publish_blocks`).
    """

    coordinator: HiSparseCoordinatorHooks | None = None
    # The host tier still holds prefixes the device groups lost: keep its longer hit.
    retains_longer_hit = True

    @property
    def records_new_block_ids(self) -> bool:
        # Host pages are never zeroed by the worker's device-side pass.
        return False

    def take_new_block_ids(self) -> list[int]:
        self.new_block_ids = []
        return []

    def bind_host_pool(self, num_blocks: int) -> None:
        """Swap the device pool this group was built with for a host pool of ``num_blocks``
        pages whose KV events go to the device pool's queue."""
        device_pool = self.block_pool
        collector = device_pool.metrics_collector
        self.block_pool = SharedEventQueueBlockPool(
            num_gpu_blocks=num_blocks,
            enable_caching=self.enable_caching and self.kv_cache_spec.prefix_cacheable,
            hash_block_size=device_pool.hash_block_size,
            enable_kv_cache_events=device_pool.enable_kv_cache_events,
            metrics_collector=(
                None if collector is None else KVCacheMetricsCollector(collector.sample_rate)
            ),
            medium=MEDIUM_CPU,
            event_owner=device_pool,
        )
        self._null_block = self.block_pool.null_block

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Nothing for the worker's device copy path: host copies go through the
        connector (:meth:`take_host_cow_copies`)."""
        return []

    def take_host_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Drain the host-page copy-on-write pairs (source, destination)."""
        return super().take_pending_cow_copies()

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
        """0 device pages when the host pool can back the request; otherwise more pages than
        the device pool has, so admission fails (host pages are not device pages)."""
        needed = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
        )
        if needed <= self.block_pool.get_num_free_blocks():
            return 0
        gpu_pool = _bound(self.coordinator).gpu_pool
        if gpu_pool is None:
            raise ValueError("coordinator.gpu_pool: expected a resident group's pool, got None")
        return gpu_pool.num_gpu_blocks + 1

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        if num_external_computed_tokens <= 0:
            return
        # The connector fills these host pages; they become readable only when it reports
        # the load done, not when the request's computed count moves.
        _bound(self.coordinator).record_pending_host_import(
            request_id, num_local_computed_tokens + num_external_computed_tokens
        )
        super().allocate_external_computed_blocks(
            request_id, num_local_computed_tokens, num_external_computed_tokens, record_for_zeroing
        )

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
        alignment_tokens: int | None = None,
    ) -> None:
        """Defer publication to the coordinator: only durable host pages are published."""
        _bound(self.coordinator).publish_when_ready(
            request, num_tokens, retention_interval, replay_boundaries=replay_boundaries
        )

    def publish_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
    ) -> None:
        """Publish the full host pages among the first ``num_tokens`` tokens."""
        super().cache_blocks(
            request,
            num_tokens,
            retention_interval=retention_interval,
            replay_boundaries=replay_boundaries,
        )

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        _bound(self.coordinator).free(request_id)
        return super().pop_blocks_for_free(request_id)


class _HiSparseDeviceManager(SingleTypeKVCacheManager):
    """Device groups of a request's lifetime only: the source group owns prefix caching,
    so these never publish and never hit."""

    coordinator: HiSparseCoordinatorHooks | None = None

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int] = (),
        alignment_tokens: int | None = None,
    ) -> None:
        return None

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
        return tuple([] for _ in kv_cache_group_ids), 0


class HiSparseHotManager(_HiSparseDeviceManager):
    """The hot buffer: ``blocks_per_request`` pages, taken only once a request must read
    history from the host (it was asked to, or it starts from a host prefix or import)."""

    def __init__(self, kv_cache_spec: HiSparseHotSpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.blocks_per_request = kv_cache_spec.blocks_per_request
        self.hot_required: set[str] = set()

    def require_hot(self, request_id: str) -> None:
        """Give the request its hot buffer at its next allocation."""
        self.hot_required.add(request_id)

    def has_hot(self, request_id: str) -> bool:
        return len(self.req_to_blocks.get(request_id, ())) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        """Pages the request's hot buffer still lacks."""
        return max(self.blocks_per_request - len(self.req_to_blocks.get(request_id, ())), 0)

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
        assert not new_computed_blocks, "HiSparse device groups take no prefix hits"
        imports = total_computed_tokens > num_local_computed_tokens
        # A new request starting from a host prefix reads the host at once; a running one
        # keeps the answer it was admitted with unless asked to switch.
        host_prefix = num_local_computed_tokens > 0 and request_id not in self.num_cached_block
        if imports or host_prefix or request_id in self.hot_required:
            return self.get_num_required_blocks(request_id)
        return 0

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        assert not new_computed_blocks, "HiSparse device groups take no prefix hits"
        self.num_cached_block[request_id] = 0
        if num_local_computed_tokens > 0 or not _bound(self.coordinator).resident_managers:
            self.require_hot(request_id)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        self.require_hot(request_id)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        # A request admitted without hits skips add_local_computed_blocks: mark it running.
        self.num_cached_block[request_id] = 0
        if request_id not in self.hot_required:
            return []
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = self.blocks_per_request - len(req_blocks)
        if num_new <= 0:
            return []
        fresh = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(fresh)
        return fresh

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.hot_required.discard(request_id)
        return super().pop_blocks_for_free(request_id)


class HiSparseResidentManager(_HiSparseDeviceManager):
    """The device pages of a request's context. Pages whose only copy is on the host are
    the null page. The block table stays append-only: pages the coordinator adopts or
    drops later are kept as per-request overrides (``residency_changes``) that the worker
    receives as residency updates."""

    def __init__(self, kv_cache_spec: HiSparseResidentSpec, **kwargs: object) -> None:
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        # request id -> page index -> the page now read there (the null page: the host).
        self.residency_changes: dict[str, dict[int, KVCacheBlock]] = {}

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
        assert not new_computed_blocks, "HiSparse device groups take no prefix hits"
        held = len(self.req_to_blocks.get(request_id, ()))
        if total_computed_tokens > num_local_computed_tokens:
            # An import: only its last page needs a device page (it stays writable, also
            # for the last-token replay of a full prompt hit); earlier pages stay on host.
            imported = cdiv(total_computed_tokens, self.block_size)
            tail = int(self.get_resident_page(request_id, imported - 1) is None)
            return tail + max(cdiv(num_tokens, self.block_size) - max(imported, held), 0)
        host_pages = cdiv(num_local_computed_tokens, self.block_size)
        required = cdiv(num_tokens, self.block_size)
        cap = self.max_admission_blocks_per_request
        if apply_admission_cap and cap is not None:
            required = min(required, cap)
        return max(required - max(held, host_pages), 0)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """A writable device page for the import's last page; the others stay on host."""
        if num_external_computed_tokens <= 0:
            raise ValueError(
                "num_external_computed_tokens: expected > 0 (tokens), got "
                f"{num_external_computed_tokens}"
            )
        num_tokens = num_local_computed_tokens + num_external_computed_tokens
        blocks = self.req_to_blocks.setdefault(request_id, [])
        tail = (num_tokens - 1) // self.block_size
        if len(blocks) <= tail:
            blocks.extend([self._null_block] * (tail + 1 - len(blocks)))
        if self.get_resident_page(request_id, tail) is None:
            blocks[tail] = self.block_pool.get_new_blocks(1)[0]

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        assert not new_computed_blocks, "HiSparse device groups take no prefix hits"
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"request {request_id!r} holds pages but is not running"
        # The hit lives in the host group: these pages start host-only.
        num_host_pages = cdiv(num_local_computed_tokens, self.block_size)
        req_blocks.extend([self._null_block] * num_host_pages)
        self.num_cached_block[request_id] = 0
        _bound(self.coordinator).commit_computed_blocks(request_id, num_host_pages)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        fresh = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(fresh)
        return fresh

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The pages the request still pins; the coordinator has released the rest (the
        unpinned copies stay readable until the pool reuses them)."""
        _bound(self.coordinator).free(request_id)
        blocks = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        super().pop_blocks_for_free(request_id)
        return cast(list[KVCacheBlock], trim_null_head(blocks))

    def adopt_resident_page(self, request_id: str, block_idx: int, block: KVCacheBlock) -> bool:
        """Read host-only page ``block_idx`` from ``block`` (a device copy of it); False when
        the page is out of range or already on the device."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or block_idx >= len(blocks):
            return False
        if self.get_resident_page(request_id, block_idx) is not None:
            return False
        self.residency_changes.setdefault(request_id, {})[block_idx] = block
        return True

    def drop_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """Read page ``block_idx`` from the host from now on; the device page it was read
        from (None: it was host-only already)."""
        block = self.get_resident_page(request_id, block_idx)
        if block is not None:
            self.residency_changes.setdefault(request_id, {})[block_idx] = self._null_block
        return block

    def get_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """The device page page ``block_idx`` is read from; None when it is host-only."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or block_idx >= len(blocks):
            return None
        block = self.residency_changes.get(request_id, {}).get(block_idx, blocks[block_idx])
        return None if block.is_null else block

    def get_residency_row(self, request_id: str, start: int = 0) -> list[KVCacheBlock]:
        """The pages read from ``start`` on, changes applied; host-only pages are the null
        page."""
        blocks = self.req_to_blocks.get(request_id, [])[start:]
        changes = self.residency_changes.get(request_id)
        if not changes:
            return blocks
        return [changes.get(i, block) for i, block in enumerate(blocks, start)]
