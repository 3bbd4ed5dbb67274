"""Speculative decoding settings the KV-cache functions read (upstream's ``SpeculativeConfig``,
reduced)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SpeculativeConfig"]

EAGLE_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark")
"""Methods whose draft layers live in the target model's KV cache (an EAGLE group)."""

HIDDEN_STATE_ONLY_METHODS = ("dflash", "dspark")
"""EAGLE-family methods whose draft KV at a position reads only the target's hidden state
(not the next token), so the trailing prefix-cache block stays valid."""


@dataclass
class SpeculativeConfig:
    """``method`` names the drafter; ``num_speculative_tokens`` tokens are proposed per step."""

    method: str | None = None
    num_speculative_tokens: int = 1
    disable_eagle_block_drop: bool = False
    """Keep the trailing prefix-cache block an EAGLE-style drafter would invalidate
    (experimental, as upstream)."""
    disable_lookahead_block_hashes: bool = False
    """Hash blocks without the tokens the drafter reads after them (drop the trailing block
    instead); engines sharing a KV store or events must agree on it."""
    draft_model_config: Any = None
    """The drafter's model config; its ``hf_config.num_nextn_predict_layers`` counts MTP
    modules."""

    def use_eagle(self) -> bool:
        """True for the drafters that keep their KV in the target's cache."""
        return self.method in EAGLE_METHODS

    def needs_eagle_block_drop(self) -> bool:
        """True when a position's draft KV depends on the next token (EAGLE, EAGLE3, MTP)."""
        return self.use_eagle() and self.method not in HIDDEN_STATE_ONLY_METHODS

    def use_eagle_block_drop(self) -> bool:
        """True when the trailing, still-volatile prefix-cache block must be dropped."""
        return self.needs_eagle_block_drop() and not self.disable_eagle_block_drop

    def use_multi_module_mtp(self) -> bool:
        """True for MTP with more than one module used per step."""
        if self.method != "mtp" or self.draft_model_config is None:
            return False
        hf_config = getattr(self.draft_model_config, "hf_config", None)
        layers = getattr(hf_config, "num_nextn_predict_layers", 1)
        return min(layers, self.num_speculative_tokens) > 1
