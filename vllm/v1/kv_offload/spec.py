"""Offloading specs: what is offloaded, in which block size, and by which handlers.

Units: every ``*block_size`` is in tokens; byte quantities are named ``*_bytes``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm.utils import check_positive_int
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import LoadStoreSpec
from vllm.v1.kv_offload.worker.worker import OffloadingHandler

if TYPE_CHECKING:
    from vllm.config.cache import CacheConfig
    from vllm.v1.kv_offload.worker.page_views import LayerKVCache


class OffloadingSpec(ABC):
    """How a worker's KV cache is offloaded.

    Args:
        kv_cache_config: the worker's KV-cache layout; its groups give the GPU block sizes.
        block_size: the engine's (hash) block size in tokens (``CacheConfig.block_size``).
        extra_config: connector options (upstream's ``kv_connector_extra_config``).
            ``"block_size"``: offloaded block size in tokens, a multiple of every GPU block
            size (default: the largest GPU block size). ``"block_size_factor"``: the same,
            as a multiple of the GPU block size (offloaded = GPU block size × factor).

    Pages move per GPU block id: block id ``b`` indexes one page in every
    :class:`KVCacheTensor`, whatever the block size of the group that uses the tensor. An
    offloaded block holds the pages of ``block_size_factor`` consecutive GPU block ids of every
    tensor. With one GPU block size ``g`` across groups that is ``offloaded_block_size / g``
    tokens' worth of GPU blocks. With mixed GPU block sizes (hybrid planner output, e.g.
    DeepSeek-V4's 256/1024/4096/32768-token groups, or Mamba + attention groups) one block id
    covers a different number of tokens in each group, so a factor > 1 has no single meaning in
    tokens: the offloaded block mirrors the GPU layout exactly (factor 1, one GPU block id per
    offloaded block) and ``offloaded_block_size`` is the largest GPU block size; asking for a
    larger offloaded block (``"block_size"`` or ``"block_size_factor"``) raises ``ValueError``.
        cp_size: context-parallel world size; ``hash_block_size = block_size * cp_size``.

    Raises:
        ValueError: when a group's GPU block size is not a multiple of ``hash_block_size``,
            with the message ``gpu_block_size=<b> not divisible by hash_block_size=<h>.
            Hybrid models (e.g. Mamba+Attention) need --enable-prefix-caching to align block
            sizes.`` (a Mamba group without prefix caching has a block size of
            ``max_model_len``); when the offloaded block size is not a multiple of every GPU
            block size; or when the groups have different GPU block sizes and the offloaded
            block size is not the largest of them (a ``block_size_factor`` > 1).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        block_size: int,
        extra_config: Mapping[str, Any] | None = None,
        cp_size: int = 1,
    ):
        self.kv_cache_config = kv_cache_config
        self.extra_config: dict[str, Any] = dict(extra_config or {})
        self.hash_block_size = check_positive_int("block_size", block_size) * check_positive_int(
            "cp_size", cp_size
        )
        self.gpu_block_size: tuple[int, ...] = tuple(
            group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups
        )
        for gpu_block_size in self.gpu_block_size:
            if gpu_block_size % self.hash_block_size != 0:
                raise ValueError(
                    f"gpu_block_size={gpu_block_size} not divisible by "
                    f"hash_block_size={self.hash_block_size}. Hybrid models (e.g. "
                    "Mamba+Attention) need --enable-prefix-caching to align block sizes."
                )
        self.offloaded_block_size = self._offloaded_block_size()
        sizes = set(self.gpu_block_size)
        if len(sizes) > 1 and self.offloaded_block_size != max(sizes):
            raise ValueError(
                f"extra_config: an offloaded block of {self.offloaded_block_size} tokens needs "
                f"a block_size_factor > 1, which is only supported when every KV-cache group "
                f"has the same GPU block size; got GPU block sizes {list(self.gpu_block_size)}. "
                "With mixed GPU block sizes an offloaded block mirrors one GPU block id "
                f"(block_size_factor 1, block_size {max(sizes)}): leave 'block_size' and "
                "'block_size_factor' unset."
            )
        self._block_size_factor = self.offloaded_block_size // max(
            sizes, default=self.hash_block_size
        )

    def _offloaded_block_size(self) -> int:
        largest = max(self.gpu_block_size, default=self.hash_block_size)
        size = self.extra_config.get("block_size")
        factor = self.extra_config.get("block_size_factor")
        if factor is not None:
            factor_size = check_positive_int("extra_config['block_size_factor']", factor) * largest
            if size is not None and int(size) != factor_size:
                raise ValueError(
                    f"extra_config: block_size={size} tokens disagrees with "
                    f"block_size_factor={factor} × GPU block size {largest} = {factor_size}"
                )
            size = factor_size
        if size is None:
            return largest
        size = check_positive_int("extra_config['block_size']", int(size))
        bad = [b for b in self.gpu_block_size if size % b != 0]
        if bad:
            raise ValueError(
                f"extra_config['block_size']: the offloaded block size ({size} tokens) must be "
                f"a multiple of every GPU block size, got GPU block sizes "
                f"{list(self.gpu_block_size)}"
            )
        return size

    @property
    def block_size_factor(self) -> int:
        """GPU block ids (pages of every KV-cache tensor) per offloaded block.

        ``offloaded_block_size // gpu_block_size`` with one GPU block size; always 1 when the
        groups' GPU block sizes differ (the offloaded block mirrors one GPU block id).
        """
        return self._block_size_factor

    @classmethod
    def from_cache_config(
        cls,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        extra_config: Mapping[str, Any] | None = None,
        cp_size: int = 1,
    ) -> OffloadingSpec:
        """Build the spec with ``cache_config.block_size`` as the (hash) block size."""
        return cls(kv_cache_config, cache_config.block_size, extra_config, cp_size)

    @abstractmethod
    def get_handlers(
        self,
        kv_caches: Mapping[str, LayerKVCache],
        kv_cache_config: KVCacheConfig | None = None,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """The handlers that move the worker's ``kv_caches``: (source spec class, destination
        spec class, handler) triples. ``kv_cache_config`` defaults to the spec's."""
