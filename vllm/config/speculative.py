"""Speculative decoding settings the KV-cache functions read (upstream's ``SpeculativeConfig``,
reduced)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpeculativeConfig"]

EAGLE_METHODS = ("eagle", "eagle3", "mtp", "dflash")
"""Methods whose draft layers live in the target model's KV cache (an EAGLE group)."""


@dataclass
class SpeculativeConfig:
    """``method`` names the drafter; ``num_speculative_tokens`` tokens are proposed per step."""

    method: str | None = None
    num_speculative_tokens: int = 1

    def use_eagle(self) -> bool:
        """True for the drafters that keep their KV in the target's cache."""
        return self.method in EAGLE_METHODS
