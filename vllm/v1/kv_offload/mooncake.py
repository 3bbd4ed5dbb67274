"""Offloading to a Mooncake distributed store, shared by every engine instance that uses it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NoReturn

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import MooncakeConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import MooncakeStoreClient
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingHandler,
    OffloadingSpec,
)
from vllm.v1.kv_offload.page_format import KVPageFormat
from vllm.v1.kv_offload.worker.mooncake_store import (
    DEFAULT_KEY_PREFIX,
    MooncakeLoadStoreSpec,
    MooncakeStoreHandlers,
    MooncakeStorePages,
)
from vllm.v1.kv_offload.worker.page_views import KVCachePageView, canonical_page_tensor

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_FORMAT_KEYS = ("model", "kv_cache_dtype", "tp_rank", "scale_layouts", "kv_scales")


class MooncakeOffloadingSpec(OffloadingSpec):
    """Offload KV-cache blocks to a Mooncake store (``GPU`` <-> ``MOONCAKE`` handlers).

    ``extra_config`` (besides the block-size options of :class:`OffloadingSpec`):
    ``"model"`` (required) and ``"kv_cache_dtype"`` (default ``"auto"``), ``"tp_rank"``,
    ``"scale_layouts"`` and ``"kv_scales"`` (see :meth:`KVPageFormat.from_kv_cache_config`):
    with the KV-cache config they make the format fingerprint in every key, so instances
    share exactly the blocks they can read. ``"mooncake"``: a mapping of
    :class:`MooncakeConfig` fields (unset fields come from the ``MOONCAKE_*`` environment);
    ``"key_prefix"`` (default ``"vllm-kv"``); ``"max_blocks_per_batch"`` (default 256).

    Store-side block ids are block hashes (:class:`MooncakeLoadStoreSpec`), one per offloaded
    block of ``block_size_factor`` GPU block ids.
    """

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, kv_cache_config)
        if "model" not in self.extra_config:
            raise ValueError(
                "extra_config['model']: expected the model name (part of every store key), "
                "got nothing"
            )
        self.mooncake_config = MooncakeConfig.from_mapping(self.extra_config.get("mooncake"))
        self.key_prefix = str(self.extra_config.get("key_prefix", DEFAULT_KEY_PREFIX))
        self.max_blocks_per_batch = int(self.extra_config.get("max_blocks_per_batch", 256))
        self._handlers: MooncakeStoreHandlers | None = None

    def page_format(self, kv_cache_config: KVCacheConfig | None = None) -> KVPageFormat:
        """The format of the offloaded blocks of ``kv_cache_config`` (default: the spec's)."""
        options = {k: self.extra_config[k] for k in _FORMAT_KEYS if k in self.extra_config}
        options.setdefault("kv_cache_dtype", "auto")
        return KVPageFormat.from_kv_cache_config(
            kv_cache_config or self.kv_cache_config,
            block_size_factor=self.block_size_factor,
            **options,
        )

    @property
    def handlers(self) -> MooncakeStoreHandlers | None:
        """The handlers built by :meth:`get_handlers` (None before)."""
        return self._handlers

    def lookup(self, block_hashes: Iterable[bytes | int]) -> int:
        """Leading blocks of a prefix present in the store (after :meth:`get_handlers`)."""
        if self._handlers is None:
            raise RuntimeError("lookup: register the KV cache first (get_handlers)")
        return self._handlers.lookup(block_hashes)

    def get_manager(self) -> NoReturn:
        raise NotImplementedError(
            "MooncakeOffloadingSpec: the store has no scheduler-side manager yet; ask the "
            "worker's handlers (lookup) which prefix blocks it holds"
        )

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if self._handlers is None:
            config = self.kv_cache_config
            views = [
                KVCachePageView(
                    tensor_index=i,
                    layer_names=tuple(config.kv_cache_tensors[i].shared_by),
                    page_size_bytes=t.page_size_bytes,
                    pages=canonical_page_tensor(t, f"kv_caches.tensors[{i}]"),
                )
                for i, t in enumerate(kv_caches.tensors)
            ]
            page_format = self.page_format(config)
            client = MooncakeStoreClient(self.mooncake_config)
            try:
                pages = MooncakeStorePages(
                    client, views, page_format, self.key_prefix, self.max_blocks_per_batch
                )
            except BaseException:
                client.close()
                raise
            self._handlers = MooncakeStoreHandlers(pages)
        yield GPULoadStoreSpec, MooncakeLoadStoreSpec, self._handlers.store_handler
        yield MooncakeLoadStoreSpec, GPULoadStoreSpec, self._handlers.load_handler
