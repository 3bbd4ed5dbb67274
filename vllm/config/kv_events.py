"""KV-cache event settings (upstream's ``KVEventsConfig``, reduced: no publisher is run here)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVEventsConfig"]


@dataclass
class KVEventsConfig:
    """Whether block events are published, and by which publisher name."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
