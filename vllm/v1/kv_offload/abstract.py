"""Medium-independent offloading abstractions."""

from __future__ import annotations

from abc import ABC, abstractmethod


class LoadStoreSpec(ABC):
    """Where a transfer reads from or writes to: a medium plus addresses in it."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """Name of the medium this spec addresses (e.g. ``"GPU"``, ``"CPU"``)."""
