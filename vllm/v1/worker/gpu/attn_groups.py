"""Attention groups (layers of one KV-cache group that share a backend and spec, so one metadata
builder) and the kernel block sizes they run at (upstream's ``vllm.v1.worker.utils`` names).

A backend may need blocks smaller than the KV-cache manager's (its *kernel* blocks): a manager
block of ``block_size`` tokens is then ``block_size // kernel_block_size`` kernel blocks, and
the group's block tables and cache views address kernel blocks (kernel block ``j`` of manager
block ``b`` is ``b * stride + j``, ``stride`` being the kernel blocks per manager block unless
other layers' pages sit between a packed cache's blocks). Units: block sizes in tokens.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)

__all__ = [
    "AttentionGroup",
    "customize_attention_spec",
    "get_block_table_width",
    "map_kv_caches_to_kernel_blocks",
    "prepare_kernel_block_sizes",
    "select_common_block_size",
    "select_kernel_block_size",
]


def _supported_sizes(backend: Any, spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
    """The backend's kernel block sizes, for ``spec`` when its method takes one (upstream
    v0.33 passes the spec; the library's backends answer without)."""
    method = backend.get_supported_kernel_block_sizes
    if spec is not None and inspect.signature(method).parameters:
        return list(method(spec))
    return list(method())


def _fits(sizes: Sequence[int | MultipleOf], size: int) -> bool:
    """Whether ``size`` is one of ``sizes`` (an int matches exactly, ``MultipleOf`` any
    multiple of its base)."""
    return any(size % s.base == 0 if isinstance(s, MultipleOf) else size == s for s in sizes)


def _supports_kernel_block_size(backend: Any, size: int, spec: KVCacheSpec | None = None) -> bool:
    return _fits(_supported_sizes(backend, spec), size)


def select_kernel_block_size(
    backends: Sequence[Any],
    storage_block_size: int,
    specs: Sequence[KVCacheSpec | None] | None = None,
) -> int:
    """Largest kernel block size that every backend supports (for its spec in ``specs``, when
    given) and that divides ``storage_block_size`` (slots per page); ``ValueError`` when there
    is none."""
    if isinstance(storage_block_size, bool) or storage_block_size <= 0:
        raise ValueError(f"storage_block_size: expected a positive int, got {storage_block_size}")
    pairs = zip(backends, specs if specs is not None else [None] * len(backends), strict=True)
    # Backends may be unhashable stand-ins (namespaces), so dedupe by identity.
    unique = list({(id(b), id(s)): (b, s) for b, s in pairs}.values())
    supported = [(b, _supported_sizes(b, s)) for b, s in unique]
    for size in range(storage_block_size, 0, -1):
        if storage_block_size % size == 0 and all(_fits(sizes, size) for _, sizes in supported):
            return size
    described = "; ".join(
        f"{b.get_name()}: "
        + ", ".join(
            f"multiples of {s.base}" if isinstance(s, MultipleOf) else str(s) for s in sizes
        )
        for b, sizes in supported
    )
    raise ValueError(
        f"kernel_block_size: no size supported by every backend of the group ({described}) "
        f"divides the block size of {storage_block_size} slots"
    )


def select_common_block_size(
    kv_manager_block_size: int,
    backends: Sequence[Any],
    kv_cache_specs: Sequence[KVCacheSpec | None] | None = None,
) -> int:
    """Upstream's name: ``kv_manager_block_size`` when every backend takes it, else the
    largest divisor of it they all take (``ValueError`` when none)."""
    return select_kernel_block_size(backends, kv_manager_block_size, kv_cache_specs)


def customize_attention_spec(backend: Any, spec: AttentionSpec) -> AttentionSpec:
    """The spec as ``backend`` stores it. A backend taking only fixed kernel block sizes splits
    larger blocks into them, so a packed block's stride must stay a multiple of the largest."""
    spec = backend.customize_spec(spec)
    sizes = _supported_sizes(backend, spec)
    fixed = [s for s in sizes if isinstance(s, int)]
    if spec.block_stride_alignment is None and sizes and fixed == sizes:
        spec = replace(spec, block_stride_alignment=MultipleOf(max(fixed)))
    return spec


def get_block_table_width(
    max_num_blocks: int, block_size: int, *, token_alignment: int | None = 128
) -> int:
    """Block-table columns for ``max_num_blocks`` blocks of ``block_size`` tokens, padded so
    that a row spans a multiple of ``token_alignment`` tokens (None: no padding)."""
    if token_alignment is None:
        return max_num_blocks
    if token_alignment <= 0:
        raise ValueError(f"token_alignment: expected a positive int or None, got {token_alignment}")
    alignment = token_alignment // math.gcd(token_alignment, block_size)
    return cdiv(max_num_blocks, alignment) * alignment


@dataclass(eq=False)
class AttentionGroup:
    """``kernel_block_size``: set when the backend needs blocks smaller than the manager's;
    ``kernel_block_stride``: kernel blocks between two manager blocks of a packed cache (0:
    the kernel blocks per manager block); ``kernel_block_table``: the mapped tables, one per
    metadata builder (persistent, so that CUDA graphs capture them)."""

    backend: type[AttentionBackend]
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    kv_cache_group_id: int
    kernel_block_size: int | None = None
    kernel_block_stride: int = 0
    kernel_block_table: torch.Tensor | None = None
    kernel_block_offsets: torch.Tensor | None = None
    metadata_builders: list[Any] = field(default_factory=list)

    def create_metadata_builders(
        self,
        vllm_config: Any,
        device: torch.device | str,
        kernel_block_size: int | None = None,
        num_metadata_builders: int = 1,
    ) -> None:
        """One builder per microbatch; builders of a split group see kernel blocks."""
        spec = self.kv_cache_spec
        if kernel_block_size is not None and isinstance(spec, AttentionSpec):
            kernel_block_size = select_common_block_size(kernel_block_size, [self.backend], [spec])
            if kernel_block_size != spec.block_size:
                self.kernel_block_size = kernel_block_size
        builder_spec = (
            spec if kernel_block_size is None else spec.copy_with_new_block_size(kernel_block_size)
        )
        builder_cls = self.backend.get_builder_cls()
        kwargs: dict[str, Any] = {}
        if builder_cls.requires_block_table_width or self.kernel_block_size is not None:
            max_num_blocks = spec.max_num_blocks_per_req(
                vllm_config, vllm_config.model_config.max_model_len
            )
            width = get_block_table_width(max_num_blocks, spec.block_size)
            if kernel_block_size is not None:
                width *= spec.block_size // kernel_block_size
            if builder_cls.requires_block_table_width:
                kwargs["block_table_width"] = width
            if self.kernel_block_size is not None:
                self.kernel_block_table = torch.zeros(
                    num_metadata_builders,
                    vllm_config.scheduler_config.max_num_seqs,
                    width,
                    dtype=torch.int32,
                    device=device,
                )
                self.kernel_block_offsets = torch.arange(
                    spec.block_size // self.kernel_block_size, dtype=torch.int32, device=device
                )
        self.metadata_builders = [
            builder_cls(builder_spec, self.layer_names, vllm_config, device, **kwargs)
            for _ in range(num_metadata_builders)
        ]

    def get_metadata_builder(self, ubatch_id: int = 0) -> Any:
        if not 0 <= ubatch_id < len(self.metadata_builders):
            raise ValueError(
                f"ubatch_id: expected one of the group's {len(self.metadata_builders)} "
                f"metadata builders, got {ubatch_id}"
            )
        return self.metadata_builders[ubatch_id]

    def build_metadata(
        self,
        common_attn_metadata: Any,
        ubatch_idx: int = 0,
        common_prefix_len: int = 0,
        **kwargs: Any,
    ) -> Any:
        return self.get_metadata_builder(ubatch_idx).build(
            common_prefix_len,
            self._with_kernel_block_table(common_attn_metadata, ubatch_idx),
            **kwargs,
        )

    def build_metadata_for_cudagraph_capture(
        self, common_attn_metadata: Any, ubatch_idx: int = 0
    ) -> Any:
        return self.get_metadata_builder(ubatch_idx).build_for_cudagraph_capture(
            self._with_kernel_block_table(common_attn_metadata, ubatch_idx)
        )

    def _with_kernel_block_table(self, common_attn_metadata: Any, ubatch_idx: int = 0) -> Any:
        if self.kernel_block_size is None:
            return common_attn_metadata
        return replace(
            common_attn_metadata,
            block_table_tensor=self.map_to_kernel_block_table(
                common_attn_metadata.block_table_tensor, ubatch_idx
            ),
        )

    def map_to_kernel_block_table(
        self, block_table: torch.Tensor, ubatch_idx: int = 0
    ) -> torch.Tensor:
        """Manager block ``b`` in column ``c`` → kernel blocks ``b * stride + j``."""
        if self.kernel_block_size is None:
            return block_table
        assert self.kernel_block_table is not None and self.kernel_block_offsets is not None
        per_block = self.kv_cache_spec.block_size // self.kernel_block_size
        rows, cols = block_table.shape
        out = self.kernel_block_table[ubatch_idx, :rows, : cols * per_block]
        torch.add(
            self.kernel_block_offsets,
            block_table.unsqueeze(-1),
            alpha=self.kernel_block_stride or per_block,
            out=out.unflatten(1, (cols, -1)),
        )
        return out

    def map_kv_cache_to_kernel_blocks(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``kv_cache`` (``[B, H, N, C]`` in manager blocks) viewed in kernel blocks. Only a
        compressed one-head cache can be split: token caches are written through manager
        slot mappings. ``ValueError`` otherwise."""
        assert self.kernel_block_size is not None
        spec = self.kv_cache_spec
        rows = spec.get_num_kernel_states(self.kernel_block_size)
        if kv_cache.shape[-2] == rows:
            return kv_cache
        if (
            spec.tokens_per_state <= 1
            or kv_cache.shape[1] != 1
            or kv_cache.stride(0) % (rows * kv_cache.stride(-2))
        ):
            raise ValueError(
                f"kv_cache: {self.backend.get_name()} needs {self.kernel_block_size}-token "
                f"kernel blocks, which packed {spec.block_size}-token blocks cannot be split "
                "into; lower the block size or use a layer-compact layout (e.g. LBNHC)"
            )
        page_stride = rows * kv_cache.stride(-2)
        self.kernel_block_stride = kv_cache.stride(0) // page_stride
        num_pages = (kv_cache.shape[0] - 1) * self.kernel_block_stride + kv_cache.shape[-2] // rows
        # as_strided: the view steps over the other layers' pages between blocks.
        return kv_cache.as_strided(
            (num_pages, *kv_cache.shape[1:-2], rows, kv_cache.shape[-1]),
            (page_stride, *kv_cache.stride()[1:]),
        )


def map_kv_caches_to_kernel_blocks(
    kv_caches: dict[str, torch.Tensor], attn_groups: Iterable[AttentionGroup]
) -> dict[str, torch.Tensor]:
    """The views layers bind: split groups' caches in kernel blocks, the others as given
    (``kv_caches`` itself keeps the manager views, which KV connectors read)."""
    mapped = dict(kv_caches)
    for group in attn_groups:
        if group.kernel_block_size is not None:
            mapped.update(
                (name, group.map_kv_cache_to_kernel_blocks(kv_caches[name]))
                for name in group.layer_names
                if name in kv_caches
            )
    return mapped


def prepare_kernel_block_sizes(
    kv_cache_config: KVCacheConfig, attn_groups: list[list[AttentionGroup]]
) -> list[int]:
    """Kernel block size per KV-cache group (encoder-only groups get none): attention groups
    take the common size of their backends, unless a block-outermost tensor packs other
    layers' pages between their blocks; other caches keep their block size."""
    sizes: list[int] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, EncoderOnlyAttentionSpec):
            continue
        if not spec.has_layer_views or not isinstance(spec, AttentionSpec):
            sizes.append(spec.block_size)
            continue
        block_size = group.kv_cache_spec.block_size
        packed = any(
            t.block_stride is not None and t.block_stride > t.layer_stride
            for t in kv_cache_config.kv_cache_tensors
            if not set(t.layers).isdisjoint(group.layer_names)
        )
        groups = attn_groups[gid]
        sizes.append(
            block_size
            if packed
            else select_common_block_size(
                block_size, [g.backend for g in groups], [g.kv_cache_spec for g in groups]
            )
        )
    return sizes
