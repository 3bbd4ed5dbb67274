"""Upstream's ``SamplingParams``, reduced to the fields a request's KV-cache bookkeeping reads:
its token budget, whether it may read the prefix cache (prompt logprobs need every prompt token
recomputed), and the stop tokens the generation config adds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SamplingParams"]


@dataclass
class SamplingParams:
    """How a request samples; lengths in tokens."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    # None: decided from prompt_logprobs in __post_init__.
    skip_reading_prefix_cache: bool | None = None
    extra_args: dict[str, Any] | None = None
    _eos_token_id: int | None = field(default=None, init=False, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens: expected an int >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens: expected an int >= 0, got {self.min_tokens!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._all_stop_token_ids = set(self.stop_token_ids)
        if self.skip_reading_prefix_cache is None:
            # Cached prompt tokens have no logprobs to return, so such requests recompute.
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """Take the model's EOS token and any extra EOS ids of its generation config."""
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        extra = generation_config.get("eos_token_id")
        if extra is None:
            return
        extra_ids = {extra} if isinstance(extra, int) else set(extra)
        extra_ids.discard(eos_token_id)  # type: ignore[arg-type]
        if not extra_ids:
            return
        self._all_stop_token_ids.update(extra_ids)
        if not self.ignore_eos:
            assert self.stop_token_ids is not None
            self.stop_token_ids = sorted(extra_ids | set(self.stop_token_ids))
