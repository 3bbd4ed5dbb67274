"""The base of the KV-cache specs (:mod:`vllm.v1.kv_cache_interface` re-exports every name):
the abstract spec, the merge rule and its error, the field checks, and the Mamba state spec.

Units: ``block_size`` is in tokens per page, every ``*_bytes`` quantity is in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from vllm.utils.math_utils import cdiv, round_up
from vllm.utils.torch_utils import get_dtype_size

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = [
    "KVCacheSpec",
    "KVCacheSpecMergeError",
    "MambaSpec",
    "cdiv",
    "round_up",
]


def _check_torch_dtype(name: str, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name}: expected a torch.dtype, got {value!r} ({type(value).__name__})")


def _as_torch_dtype(name: str, value: object) -> torch.dtype:
    """``value`` as a torch dtype: a dtype, or the name of one (``"float16"``: upstream's
    tests build specs with dtype names); ``ValueError`` otherwise."""
    named = getattr(torch, value, None) if isinstance(value, str) else value
    _check_torch_dtype(name, named if isinstance(named, torch.dtype) else value)
    assert isinstance(named, torch.dtype)
    return named


def _check_positive(spec: object, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{name}: expected a positive int for {type(spec).__name__}, got {value!r}"
            )


class KVCacheSpecMergeError(ValueError, AssertionError):
    """Specs that cannot share one group. A ``ValueError`` like every spec error here, and an
    ``AssertionError`` because upstream's merge asserts (engines catch that)."""


def _max_model_len(vllm_config: VllmConfig) -> int:
    """``vllm_config.model_config.max_model_len`` (tokens), which every bound here needs."""
    model_config = vllm_config.model_config
    if model_config is None or model_config.max_model_len is None:
        raise ValueError("vllm_config.model_config.max_model_len: expected tokens, got None")
    return model_config.max_model_len


def _check_optional_positive(spec: object, *names: str) -> None:
    for name in names:
        if getattr(spec, name) is not None:
            _check_positive(spec, name)


def _merge_window(specs: list[Any], name: str) -> int | None:
    """The one non-None ``name`` (tokens) among ``specs``, None when none sets it."""
    values = {getattr(spec, name) for spec in specs} - {None}
    if len(values) > 1:
        raise ValueError(
            f"{name}: layers of one KV cache group need one value, got {sorted(values)}"
        )
    return values.pop() if values else None


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """A layer's KV-cache page: ``block_size`` tokens. Constructible (as upstream) so specs can
    be compared and grouped by their common fields; sizing needs a concrete subclass."""

    block_size: int
    dcp_sharded: bool = False
    """True when decode context parallelism splits this cache's token positions across ranks
    (each rank keeps 1/dcp of them)."""
    is_draft: bool = field(default=False, compare=False)
    """True for a draft model's layer; not part of the cache format, so never splits groups."""
    block_stride_alignment: int | Any | None = None
    """Bytes the spacing of this layer's blocks must be a multiple of (an int), or whole kernel
    blocks of up to ``MultipleOf(n).base`` tokens (a backend's ``MultipleOf``); None: none."""

    def __post_init__(self) -> None:
        alignment = self.block_stride_alignment
        base = alignment if isinstance(alignment, int) else getattr(alignment, "base", None)
        if alignment is not None and (
            isinstance(base, bool) or not isinstance(base, int) or base <= 0
        ):
            raise ValueError(
                "block_stride_alignment: expected a positive int or MultipleOf (alignments must "
                f"be positive), got {alignment!r}"
            )

    def get_block_stride_alignment(self) -> int:
        """Bytes the block spacing must be a multiple of: the int given; for ``MultipleOf(n)``
        the page of ``gcd(n, block_size)`` tokens (1 when that is the whole block)."""
        alignment = self.block_stride_alignment
        if alignment is None:
            return 1
        if isinstance(alignment, int):
            return alignment
        kernel = math.gcd(alignment.base, self.block_size)
        if kernel == self.block_size:
            return 1
        return self.copy_with_new_block_size(kernel).page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page as allocated (padding included)."""
        raise self._no_layout("page_size_bytes")

    def _no_layout(self, what: str) -> TypeError:
        return TypeError(
            f"{what}: expected a concrete KV cache spec (FullAttentionSpec, MambaSpec, ...), "
            f"got the base {type(self).__name__}, which has no page layout"
        )

    @property
    def prefix_cacheable(self) -> bool:
        """True when this spec's group takes part in prefix caching."""
        return True

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens a prefix hit must recompute before the cached state is usable (0: none)."""
        return 0

    @property
    def block_table_token_alignment(self) -> int | None:
        """Tokens a block-table row's span is padded to (None: no padding)."""
        return 128

    @property
    def has_layer_views(self) -> bool:
        """True when allocation gives each layer a shaped view of the raw buffer; False for
        specs that lay out their raw bytes themselves (and have no attention backend)."""
        return True

    @property
    def uses_slot_mapping(self) -> bool:
        """True when the worker computes a per-token slot mapping row for this spec."""
        return True

    def max_num_blocks_per_req(self, vllm_config: VllmConfig, max_len: int) -> int:
        """Block-table entries one request of ``max_len`` tokens needs (a row's width)."""
        return cdiv(max_len, self.block_size)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one page without padding (the page itself unless a spec pads)."""
        return self.page_size_bytes

    @property
    def unpadded_page_size_bytes(self) -> int:
        """Upstream v0.33's name of :attr:`real_page_size_bytes`."""
        return self.real_page_size_bytes

    @property
    def num_heads(self) -> int:
        """H of the page's logical ``[H, N, C]`` grid (1 unless a spec has heads)."""
        return 1

    @property
    def tokens_per_state(self) -> int | Fraction:
        """Tokens one stored state (an N row of the grid) covers: 1 for a plain cache,
        the compression ratio for a compressed one."""
        ratio = Fraction(self.block_size, self.storage_block_size)
        return ratio.numerator if ratio.denominator == 1 else ratio

    @property
    def num_states(self) -> int:
        """N of the page's grid: states stored per page."""
        return self.get_num_kernel_states(self.block_size)

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        """States in a kernel block of ``kernel_block_size`` tokens."""
        return int(kernel_block_size // self.tokens_per_state)

    @property
    def state_content_size_bytes(self) -> int:
        """C of the page's grid: bytes per (head, state); ``ValueError`` when the unpadded
        page is not ``H x N`` cells of equal size (an encoding with per-page extras)."""
        cells = self.num_heads * self.num_states
        page = self.real_page_size_bytes
        if cells <= 0 or page % cells:
            raise ValueError(
                f"{type(self).__name__}: a page of {page} bytes is not {self.num_heads} heads x "
                f"{self.num_states} states of equal bytes"
            )
        return page // cells

    def layer_specs(self) -> tuple[KVCacheSpec, ...]:
        """The per-layer specs this (group) spec covers: itself, unless it wraps several."""
        return (self,)

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """Most bytes one request of ``model_config.max_model_len`` tokens can hold in this
        layer (whole pages)."""
        raise self._no_layout("max_memory_usage_bytes")

    @property
    def storage_block_size(self) -> int:
        """Slots stored per page (equals ``block_size`` unless the spec compresses tokens)."""
        return self.block_size

    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        """The one spec of a group: all specs must be equal, else :class:`KVCacheSpecMergeError`
        naming the field that differs."""
        if not specs:
            raise KVCacheSpecMergeError("specs: expected at least one spec to merge, got none")
        first = specs[0]
        for other in specs[1:]:
            _check_same_fields(first, other, ())
        return first

    def copy_with_new_block_size(self, block_size: int) -> Any:
        """The same spec with pages of ``block_size`` tokens."""
        return replace(self, block_size=block_size)


def _check_same_fields(
    first: KVCacheSpec,
    other: KVCacheSpec,
    skip: tuple[str, ...],
    fields_of: type[KVCacheSpec] | None = None,
) -> None:
    """:class:`KVCacheSpecMergeError` unless ``other`` has ``first``'s class and fields (those in
    ``skip`` aside); with ``fields_of``, the classes may differ and only the fields of that
    class (which both must be) are compared."""
    if fields_of is None and type(other) is not type(first):
        raise KVCacheSpecMergeError(
            f"specs: cannot merge {type(first).__name__} with {type(other).__name__}"
        )
    for f in fields(first if fields_of is None else fields_of):
        a, b = getattr(first, f.name), getattr(other, f.name)
        if f.compare and f.name not in skip and a != b:
            raise KVCacheSpecMergeError(
                f"specs: cannot merge {type(first).__name__}s that differ in "
                f"{f.name}: {a!r} vs {b!r}"
            )


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Fixed-size recurrent state per request: one page holds every state tensor of a layer.

    ``shapes[i]`` and ``dtypes[i]`` describe state tensor i (e.g. conv and SSM state).
    ``num_speculative_blocks`` extra pages hold the states of draft tokens. A request keeps
    its states as ``cache_config.mamba_cache_mode`` says (``mamba_cache_mode`` here records
    the mode the layer was built for, as upstream).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    # align mode: pages a prefill step may add to hold a mid-chunk state checkpoint, and the
    # token multiple (from the chunk start) such a checkpoint must sit at; None: no checkpoints.
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    tp_replicated: bool = False
    """True when every tensor-parallel rank holds the whole state (upstream v0.33's replicated
    PLE conv state); False: sharded across the ranks. States of the two kinds never share a
    group."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "block_size")
        if not isinstance(self.tp_replicated, bool):
            raise ValueError(f"tp_replicated: expected a bool, got {self.tp_replicated!r}")
        for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name}: expected an int >= 0 (pages), got {n!r}")
        a = self.prefill_checkpoint_alignment
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a <= 0):
            raise ValueError(
                f"prefill_checkpoint_alignment: expected a positive int (tokens) or None, got {a!r}"
            )
        for name, value, what in (
            ("shapes", self.shapes, "state shapes"),
            ("dtypes", self.dtypes, "torch.dtypes"),
        ):
            if not isinstance(value, (tuple, list)):
                raise ValueError(
                    f"{name}: expected a tuple of {what}, got {value!r} ({type(value).__name__})"
                )
        if len(self.dtypes) == 1 and self.shapes and all(type(d) is int for d in self.shapes):
            # One state tensor given by its bare shape, ``shapes=(1, 1)`` with one dtype:
            # upstream's tests build specs that way; it reads as ``((1, 1),)``.
            object.__setattr__(self, "shapes", (tuple(self.shapes),))
        if self.shapes and len(self.dtypes) > len(self.shapes):
            # Upstream pairs shape i with dtype i and ignores dtypes past the last shape (its
            # tests build one-state specs with a two-dtype default); trimmed so every consumer
            # sees one dtype per state.
            object.__setattr__(self, "dtypes", tuple(self.dtypes[: len(self.shapes)]))
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ValueError(
                f"shapes/dtypes: expected one dtype per state shape, got {len(self.shapes)} "
                f"shapes and {len(self.dtypes)} dtypes"
            )
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes, strict=True)):
            if not isinstance(shape, (tuple, list)):  # torch.Size is a tuple
                raise ValueError(
                    f"shapes[{i}]: expected a tuple of ints (a state shape), got {shape!r} "
                    f"({type(shape).__name__})"
                )
            if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
                raise ValueError(
                    f"shapes[{i}]: expected a state shape of positive ints, got {shape!r}"
                )
            _check_torch_dtype(f"dtypes[{i}]", dtype)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded: a padded page must hold the real page of "
                f"{self.real_page_size_bytes} bytes, got {self.page_size_padded}"
            )

    @property
    def state_sizes_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor, in order."""
        return tuple(
            math.prod(shape) * get_dtype_size(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def real_page_size_bytes(self) -> int:
        return sum(self.state_sizes_bytes)

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """Pages a request holds, by ``cache_config.mamba_cache_mode``: ``all`` one per
        ``block_size`` tokens, ``align`` two plus the prefill checkpoint pages, ``none`` one;
        plus the speculative pages."""
        mode = vllm_config.cache_config.mamba_cache_mode
        if mode == "all":
            pages = cdiv(_max_model_len(vllm_config), self.block_size)
        elif mode == "align":
            pages = 2 + self.num_prefill_checkpoint_blocks
        else:
            pages = 1
        return (pages + self.num_speculative_blocks) * self.page_size_bytes

    @property
    def tokens_per_state(self) -> int | Fraction:
        """One state per page: it covers the page's ``block_size`` tokens."""
        return self.block_size

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    def max_num_blocks_per_req(self, vllm_config: VllmConfig, max_len: int) -> int:
        """Block-table entries: states are replicated across context-parallel ranks, never
        sharded. ``align`` mode indexes rows by position over the whole sequence (older states
        are nulled), so a row spans ``max_len``; otherwise the pages a request holds."""
        if vllm_config.cache_config.mamba_cache_mode == "align":
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return cdiv(self.max_memory_usage_bytes(vllm_config), self.page_size_bytes)


def get_mamba_prefill_checkpoint_position(
    num_tokens: int,
    hash_block_size: int,
    drop_eagle_block: bool,
    num_hash_lookahead_tokens: int = 0,
) -> int:
    """The token position (a multiple of ``hash_block_size``, >= 0) whose Mamba state a prefill
    of ``num_tokens`` tokens saves for reuse. Without EAGLE at least one token (and the hash's
    lookahead tokens) stays after it, so a hit still recomputes the last logits; with EAGLE the
    position is one hash block lower, as EAGLE drops the last hit block anyway."""
    if drop_eagle_block:
        position = num_tokens // hash_block_size * hash_block_size - hash_block_size
    else:
        limit = num_tokens - max(1, num_hash_lookahead_tokens)
        position = limit // hash_block_size * hash_block_size
    return max(position, 0)


def is_mamba_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether a prefill step over tokens [query_start, query_end) can save the state at
    ``checkpoint_position`` in a page of its own (all in tokens): the step starts on a hash
    boundary, the checkpoint lies strictly inside it at least one hash block past the start
    and a multiple of ``checkpoint_alignment`` away, and the page just before the step's
    running-state page lies after the page holding the step's initial state."""
    if checkpoint_alignment is None:
        return False
    if checkpoint_alignment <= 0:
        raise ValueError(
            f"checkpoint_alignment: expected a positive int (tokens), got {checkpoint_alignment}"
        )
    initial_state_page = (query_start - 1) // mamba_block_size
    checkpoint_page = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_page > initial_state_page
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )
