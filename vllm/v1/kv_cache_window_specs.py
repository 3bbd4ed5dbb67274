"""Specs whose cache keeps only a window of a request's tokens (upstream v0.33 names;
:mod:`vllm.v1.kv_cache_interface` re-exports them).

* :class:`RSWASpec`: reference sliding-window attention. The prompt stays cached in full; of
  the generated tokens only the last ``rswa_window`` stay.
* :class:`CircularBufferSpec`: one page per request used as a ring of ``block_size`` slots.

Page math is the base attention specs'. Units: ``block_size`` and windows are in tokens,
``*_bytes`` in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_cache_attention_spec import AttentionSpec, FullAttentionSpec
from vllm.v1.kv_cache_spec_base import KVCacheSpecMergeError, _check_positive

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = ["CircularBufferSpec", "RSWASpec"]


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Full attention over the prompt plus the last ``rswa_window`` generated tokens; pages
    between the prompt's tail and that window are freed while decoding, so a request holds
    about ``prompt_pages + window_pages`` pages."""

    rswa_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "rswa_window")

    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        """One spec for the group: every layer an ``RSWASpec`` with one ``rswa_window``, the
        other fields merged as for full attention."""
        if not specs:
            raise KVCacheSpecMergeError("specs: expected at least one spec to merge, got none")
        kinds = {type(s).__name__ for s in specs if not isinstance(s, RSWASpec)}
        if kinds:
            raise KVCacheSpecMergeError(
                f"specs: expected only RSWASpec layers in the group, got {sorted(kinds)}"
            )
        windows = {s.rswa_window for s in specs}
        if len(windows) != 1:
            raise KVCacheSpecMergeError(
                f"specs: R-SWA layers must share one rswa_window, got {sorted(windows)}"
            )
        # The full-attention merge ignores rswa_window; the windows are already equal.
        return replace(FullAttentionSpec.merge(specs), rswa_window=windows.pop())


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """One page per request holding the raw keys of the token group still being compressed.

    ``block_size`` (tokens) is the ring's capacity: it must exceed the compression ratio by
    the speculative lookahead, since a step stores all its rows (drafts too) before acceptance
    is known while the next step still reads the open group's committed keys.
    """

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def uses_slot_mapping(self) -> bool:
        return False

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """One page (bytes): the ring lives for the request's whole lifetime."""
        del vllm_config
        return self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config: VllmConfig, max_len: int) -> int:
        del vllm_config, max_len
        return 1
