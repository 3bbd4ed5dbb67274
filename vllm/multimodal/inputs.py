"""Upstream's multimodal input records, reduced to what the KV-cache block manager reads: where
each item's placeholder tokens sit in the prompt and the identifier that keys block hashes."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["MultiModalFeatureSpec", "MultiModalKwargsItem", "PlaceholderRange"]


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions [offset, offset + length) of one multimodal item (in tokens);
    ``is_embed`` (bool, shape ``(length,)``) marks the positions that take an embedding."""

    offset: int
    length: int
    is_embed: torch.Tensor | None = None

    @cached_property
    def embeds_cumsum(self) -> list[int] | None:
        """Running count of embedding positions (None: every position is one)."""
        return None if self.is_embed is None else self.is_embed.cumsum(dim=0).tolist()

    def get_num_embeds(self) -> int:
        """Number of embeddings the item fills in."""
        if self.embeds_cumsum is None:
            return self.length
        return self.embeds_cumsum[-1] if self.embeds_cumsum else 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlaceholderRange):
            return NotImplemented
        if (self.offset, self.length) != (other.offset, other.length):
            return False
        if self.is_embed is None or other.is_embed is None:
            return self.is_embed is None and other.is_embed is None
        return bool(torch.equal(self.is_embed, other.is_embed))

    def __hash__(self) -> int:
        return hash((self.offset, self.length))


class MultiModalKwargsItem(dict[str, torch.Tensor]):
    """The processed tensors of one multimodal item, by field name."""

    @staticmethod
    def dummy(nbytes: int = 1) -> MultiModalKwargsItem:
        """An item holding ``nbytes`` uninitialised bytes (for tests)."""
        return MultiModalKwargsItem({"dummy": torch.empty(nbytes, dtype=torch.uint8)})


@dataclass
class MultiModalFeatureSpec:
    """One multimodal item of a request. ``identifier`` (the processor hash, LoRA-prefixed when a
    LoRA is active) keys the blocks its placeholder tokens fall in."""

    data: MultiModalKwargsItem | None
    modality: str
    identifier: str
    mm_position: PlaceholderRange
    mm_hash: str | None = None
