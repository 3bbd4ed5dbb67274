"""Backend utilities: the KV-cache layout setting, slot mappings and kernel-block helpers.

Units: ``block_size`` is in tokens per page, ``storage_block_size`` in stored slots per page,
positions are token indices within a sequence, slots are ``page * slots_per_page + offset``.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, get_args

import torch

from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.v1.kv_cache_layout import KVCacheLayout, layout_from_name

if TYPE_CHECKING:
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec


class DeclaresLayouts(Protocol):
    """What :func:`get_supported_kv_cache_layouts` asks of a backend class."""

    @classmethod
    def supported_kv_cache_layouts(cls) -> Sequence[KVCacheLayout] | None: ...


KVCacheLayoutType = Literal["NHD", "HND"]
"""Physical order of one page side: ``NHD`` = token-major ``[N][H][D]``, ``HND`` = head-major."""

KV_CACHE_LAYOUTS: tuple[str, ...] = get_args(KVCacheLayoutType)

KV_CACHE_LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
"""Environment variable read when no layout was set in code."""

DEFAULT_KV_CACHE_LAYOUT: KVCacheLayoutType = "NHD"

_layout_override: KVCacheLayoutType | None = None


def validate_kv_cache_layout(layout: str, arg_name: str = "layout") -> KVCacheLayoutType:
    """Return ``layout`` (``"NHD"`` or ``"HND"``), or raise ``ValueError`` listing both."""
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(
            f"{arg_name}: unknown KV-cache layout {layout!r}; expected one of "
            f"{', '.join(repr(x) for x in KV_CACHE_LAYOUTS)}"
        )
    return layout  # type: ignore[return-value]


def get_kv_cache_layout() -> KVCacheLayoutType:
    """The KV-cache layout in effect.

    Order of precedence: :func:`set_kv_cache_layout` / :func:`kv_cache_layout` (code), then the
    ``VLLM_KV_CACHE_LAYOUT`` environment variable (read on every call; a v0.33 layout name
    gives its block interior, :func:`get_flashinfer_layout_string`), then ``"NHD"``.
    """
    if _layout_override is not None:
        return _layout_override
    env = os.environ.get(KV_CACHE_LAYOUT_ENV)
    if env:
        # v0.33's names (LBHNC, ...) name the whole layout; a page side's order is its interior.
        return validate_kv_cache_layout(
            layout_from_name(env, KV_CACHE_LAYOUT_ENV).block_interior, KV_CACHE_LAYOUT_ENV
        )
    return DEFAULT_KV_CACHE_LAYOUT


def set_kv_cache_layout(layout: str | None) -> None:
    """Set the KV-cache layout for this process (``None`` goes back to the env / default)."""
    global _layout_override
    _layout_override = None if layout is None else validate_kv_cache_layout(layout)


@contextlib.contextmanager
def kv_cache_layout(layout: str) -> Iterator[KVCacheLayoutType]:
    """Context manager: use ``layout`` inside the block, restore the previous setting after."""
    global _layout_override
    new = validate_kv_cache_layout(layout)
    previous = _layout_override
    _layout_override = new
    try:
        yield new
    finally:
        _layout_override = previous


DEFAULT_LAYOUT_PREFERENCE = (
    KVCacheLayout.LBNHC,
    KVCacheLayout.LBHNC,
    KVCacheLayout.BLNHC,
    KVCacheLayout.BLHNC,
    KVCacheLayout.BHLNC,
    KVCacheLayout.LHBNC,
)
"""The layouts of a worker whose backends declare none, most preferred first (NHD first)."""


def get_flashinfer_layout_string(layout: KVCacheLayout) -> str:
    """``layout``'s block interior in FlashInfer's names (``"NHD"`` / ``"HND"``)."""
    return layout.block_interior


def get_supported_kv_cache_layouts(
    backends: Iterable[type[DeclaresLayouts]],
) -> list[KVCacheLayout]:
    """The layouts every backend of a worker supports, most preferred first: a backend's
    ``supported_kv_cache_layouts()`` (``None``: any) in its order when all that declare agree,
    else those in every declaration, by how many put each first (ties in enum order);
    :data:`DEFAULT_LAYOUT_PREFERENCE` when none declares. ``ValueError`` when none is common."""
    declared = [
        layouts for backend in backends if (layouts := backend.supported_kv_cache_layouts())
    ] or [DEFAULT_LAYOUT_PREFERENCE]
    if all(tuple(layouts) == tuple(declared[0]) for layouts in declared):
        return list(declared[0])
    firsts = Counter(layouts[0] for layouts in declared)
    common = set.intersection(*(set(layouts) for layouts in declared))
    ranked = sorted((m for m in KVCacheLayout if m in common), key=lambda m: -firsts[m])
    if not ranked:
        names = [[m.name for m in layouts] for layouts in declared]
        raise ValueError(f"backends: expected a KV-cache layout they all support, got {names}")
    return ranked


def record_kv_cache_layout(cache_config: CacheConfig, layout_name: str) -> None:
    """Adopt a layout resolved elsewhere (the engine core); changing a resolved one raises."""
    layout = layout_from_name(layout_name, "layout_name")
    if cache_config.kv_cache_layout not in (None, layout.name):
        raise ValueError(
            f"layout_name: expected the resolved layout {cache_config.kv_cache_layout}, got "
            f"{layout.name}"
        )
    cache_config.kv_cache_layout = layout.name


def resolve_kv_cache_layout(
    vllm_config: VllmConfig,
    supported_layouts: list[list[str]],
    kv_cache_specs: Iterable[KVCacheSpec] | None = None,
) -> KVCacheLayout:
    """The one layout of the model's caches, recorded on ``vllm_config.cache_config``.

    A layout already there wins. Otherwise ``supported_layouts`` holds each worker's list
    (:func:`get_supported_kv_cache_layouts` names, most preferred first; all workers must
    report the same). Specs with per-layer views whose pages differ in heads, states or bytes
    keep only block-compact layouts (each layer's page one run of bytes); sharded and
    replicated attention caches of different page sizes (a DCP target and its draft) keep only
    block-outermost ones. ``VLLM_KV_CACHE_LAYOUT`` (or :func:`set_kv_cache_layout`) must then
    name a candidate; otherwise the first candidate is taken. Unlike upstream, no KV connector
    here asks for a layout."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_layout is not None:
        return cache_config.get_resolved_kv_cache_layout()
    if not supported_layouts or not all(supported_layouts):
        raise ValueError(
            f"supported_layouts: expected each worker's non-empty list, got {supported_layouts}"
        )
    if any(names != supported_layouts[0] for names in supported_layouts):
        raise ValueError(
            f"supported_layouts: expected every worker to report the same layouts, got "
            f"{supported_layouts}"
        )
    candidates = [layout_from_name(n, "supported_layouts") for n in supported_layouts[0]]
    specs = [spec for spec in kv_cache_specs or () if spec.has_layer_views]
    if len({(s.num_heads, s.num_states, s.page_size_bytes) for s in specs}) > 1:
        candidates = [m for m in candidates if m.is_block_compact]
        if not candidates:
            raise ValueError(
                "supported_layouts: specs whose pages differ need a block-compact layout, got "
                f"{supported_layouts[0]}"
            )
    sharding = {
        s.dcp_sharded for s in specs if isinstance(s, AttentionSpec) and s.uses_slot_mapping
    }
    if len(sharding) > 1 and len({s.page_size_bytes for s in specs}) > 1:
        candidates = [m for m in candidates if m.is_block_outermost]
        if not candidates:
            raise ValueError(
                "supported_layouts: sharded and replicated caches of different page sizes need "
                f"a block-outermost layout, got {supported_layouts[0]}"
            )
    requested = _layout_override or os.environ.get(KV_CACHE_LAYOUT_ENV)
    layout = candidates[0]
    if requested:
        layout = layout_from_name(requested, KV_CACHE_LAYOUT_ENV)
        if layout not in candidates:
            raise ValueError(
                f"{KV_CACHE_LAYOUT_ENV}: expected one of {[m.name for m in candidates]}, got "
                f"{requested}"
            )
    cache_config.kv_cache_layout = layout.name
    return layout


def map_to_kernel_blocks(block_table: torch.Tensor, blocks_per_kv_block: int) -> torch.Tensor:
    """Expand a block table of KV-manager pages into kernel pages.

    Page ``b`` of ``block_size`` slots is viewed as ``blocks_per_kv_block`` kernel pages
    ``b*k .. b*k + k-1``, so ``block_table [..., M]`` becomes ``[..., M*k]``. Slot numbers are
    unchanged: ``b*block_size + o == (b*k + o//kb)*kb + o%kb``.
    """
    check_integer_tensor("block_table", block_table)
    if blocks_per_kv_block < 1:
        raise ValueError(f"blocks_per_kv_block: expected a positive int, got {blocks_per_kv_block}")
    if blocks_per_kv_block == 1:
        return block_table
    offsets = torch.arange(blocks_per_kv_block, dtype=block_table.dtype, device=block_table.device)
    expanded = block_table.unsqueeze(-1) * blocks_per_kv_block + offsets
    return expanded.flatten(-2)


def _gather_pages(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    req_indices: torch.Tensor | None,
) -> torch.Tensor:
    """Page id of each position (int64 ``[T]``), with checks on every argument."""
    check_integer_tensor("block_table", block_table)
    check_integer_tensor("positions", positions)
    if req_indices is not None:
        check_integer_tensor("req_indices", req_indices)
    if block_size <= 0:
        raise ValueError(f"block_size: expected a positive int (tokens per page), got {block_size}")
    if positions.dim() != 1:
        raise ValueError(f"positions: expected shape [T], got {list(positions.shape)}")
    if block_table.dim() not in (1, 2):
        raise ValueError(
            f"block_table: expected shape [max_blocks] or [num_reqs, max_blocks], "
            f"got {list(block_table.shape)}"
        )
    table = block_table if block_table.dim() == 2 else block_table.unsqueeze(0)
    positions = positions.to(torch.int64)
    if req_indices is None:
        if table.shape[0] != 1:
            raise ValueError(
                f"req_indices: needed for a 2-D block_table of {table.shape[0]} requests"
            )
        req = torch.zeros_like(positions)
    else:
        if tuple(req_indices.shape) != tuple(positions.shape):
            raise ValueError(
                f"req_indices: expected shape {list(positions.shape)} (one per position), "
                f"got {list(req_indices.shape)}"
            )
        req = req_indices.to(torch.int64)
    if positions.numel() == 0:
        return positions.clone()
    if int(positions.min()) < 0:
        raise ValueError(
            f"positions: expected non-negative token positions, got {int(positions.min())}"
        )
    block_idx = positions // block_size
    if int(block_idx.max()) >= table.shape[1]:
        raise ValueError(
            f"block_table: position {int(positions.max())} needs block index "
            f"{int(block_idx.max())}, but the table has {table.shape[1]} columns"
        )
    if int(req.min()) < 0 or int(req.max()) >= table.shape[0]:
        raise ValueError(
            f"req_indices: expected values in [0, {table.shape[0]}), got "
            f"[{int(req.min())}, {int(req.max())}]"
        )
    return table.to(torch.int64)[req, block_idx]


def compute_slot_mapping(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    req_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain slot mapping: ``slot = block_table[req, pos // N] * N + pos % N`` (int64 ``[T]``).

    ``block_table`` is ``[max_blocks]`` (one request) or ``[num_reqs, max_blocks]`` with
    ``req_indices [T]`` naming each position's request; ``N = block_size`` tokens per page.
    """
    pages = _gather_pages(block_table, positions, block_size, req_indices)
    return pages * block_size + positions.to(torch.int64) % block_size


def compute_compressed_slot_mapping(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    req_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slot mapping of a compressed spec (DeepSeek-V4 style): one slot per ``r`` tokens.

    Position ``pos`` gets ``block_table[req, pos // block_size] * (block_size // r)
    + (pos % block_size) // r`` when ``(pos + 1) % r == 0`` (the last token of its run of ``r``),
    else ``-1`` (not stored). Returns int64 ``[T]``.
    """
    if compress_ratio <= 0 or block_size % compress_ratio != 0:
        raise ValueError(
            f"compress_ratio: expected a positive divisor of block_size={block_size}, "
            f"got {compress_ratio}"
        )
    storage_block_size = block_size // compress_ratio
    pages = _gather_pages(block_table, positions, block_size, req_indices)
    pos = positions.to(torch.int64)
    slots = pages * storage_block_size + (pos % block_size) // compress_ratio
    stored = (pos + 1) % compress_ratio == 0
    return torch.where(stored, slots, torch.full_like(slots, -1))


def split_kv_cache(
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)`` logical ``(B, N, H, D')`` views of one layer's cache.

    ``kv_cache`` is a ``(B, 2, N, H, D')`` tensor (its ``[:, 0]`` / ``[:, 1]`` slices) or, for
    layers whose V head size differs from K's, the ``(key_cache, value_cache)`` pair that
    ``_reshape_kv_cache`` returns.
    """
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2 or any(
            not isinstance(t, torch.Tensor) or t.dim() != 4 for t in kv_cache
        ):
            raise ValueError(
                "kv_cache: expected a (key_cache, value_cache) pair of 4-D (B, N, H, D') tensors"
            )
        return kv_cache[0], kv_cache[1]
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        shape = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache)
        raise ValueError(
            f"kv_cache: expected a (B, 2, N, H, D') tensor or a (key_cache, value_cache) pair, "
            f"got {shape}"
        )
    key_cache, value_cache = kv_cache.unbind(1)  # one op: kv_cache[:, 0], kv_cache[:, 1]
    return key_cache, value_cache


def key_window(seq_len: int, query_len: int, sliding_window: int | None) -> tuple[int, int]:
    """First and last key position read by the last ``query_len`` queries of a sequence of
    ``seq_len`` tokens; with a sliding window ``W`` the query at ``p`` sees ``(p - W, p]``."""
    first_query = seq_len - query_len
    first_key = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
    return first_key, seq_len - 1


def check_sequences(
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
    num_blocks: int,
    sliding_window: int | None,
) -> None:
    """Per-sequence checks of paged-attention metadata, before anything is written or read:
    an integer ``block_table``, ``0 <= query_len <= seq_len``, a table column for every page
    a sequence reads, and page ids in ``[0, num_blocks)`` wherever a sequence reads
    (``ValueError`` naming the argument)."""
    check_integer_tensor("block_table", block_table)
    columns = block_table.shape[1]
    last_pages = [-1] * len(seq_lens)  # -1: the sequence reads no page
    for i, (seq_len, start, end) in enumerate(
        zip(seq_lens, query_start_loc[:-1], query_start_loc[1:], strict=True)
    ):
        q_len = end - start
        if q_len < 0 or q_len > seq_len:
            raise ValueError(
                f"seq_lens: sequence {i} has {seq_len} tokens but {q_len} query tokens"
            )
        if q_len and (seq_len - 1) // block_size >= columns:
            raise ValueError(
                f"block_table: sequence {i} of {seq_len} tokens needs "
                f"{(seq_len - 1) // block_size + 1} pages of {block_size} tokens, the table has "
                f"{columns} columns"
            )
        last_pages[i] = (seq_len - 1) // block_size if q_len else -1
    width = max(last_pages, default=-1) + 1
    if width == 0:
        return
    rows = len(seq_lens)
    pages = block_table if block_table.shape == (rows, width) else block_table[:rows, :width]
    low, high = torch.aminmax(pages)
    if low.item() >= 0 and high.item() < num_blocks:  # the common case: every id in range
        return
    # Some id is out of range: is it one that a sequence reads?
    first_pages = [
        key_window(s, end - start, sliding_window)[0] // block_size
        for s, start, end in zip(seq_lens, query_start_loc[:-1], query_start_loc[1:], strict=True)
    ]
    device = block_table.device
    column = torch.arange(width, device=device)
    read = (column >= torch.tensor(first_pages, device=device)[:, None]) & (
        column <= torch.tensor(last_pages, device=device)[:, None]
    )
    bad = (read & ((pages < 0) | (pages >= num_blocks))).any(dim=1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        used = pages[i][read[i]]
        raise ValueError(
            f"block_table: sequence {i} uses pages [{int(used.min())}, {int(used.max())}], "
            f"the cache has {num_blocks} pages"
        )
