"""Upstream's ``Request``, reduced to what the KV-cache block manager reads: the token ids (prompt
then output), the block hashes kept up to date as tokens arrive, and the fields that key hashes
(LoRA, multimodal items, cache salt, prompt embeddings). Lengths are in tokens."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.sampling_params import SamplingParams

__all__ = ["ConstantList", "KV_CACHE_REPORT_MODES", "Request", "RequestStatus"]

# How a request's cached blocks are reported in KV events (``extra_args["kv_cache_report_mode"]``).
KV_CACHE_REPORT_MODES = ("incremental", "full")


class ConstantList(Sequence[int]):
    """Read-only view of a list the request owns (slices come back as plain lists)."""

    __slots__ = ("_x",)

    def __init__(self, x: list[int]) -> None:
        self._x = x

    @overload
    def __getitem__(self, item: int) -> int: ...

    @overload
    def __getitem__(self, item: slice) -> list[int]: ...

    def __getitem__(self, item: int | slice) -> int | list[int]:
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[int]:
        return iter(self._x)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._x == other._x
        return self._x == other

    def __repr__(self) -> str:
        return f"ConstantList({self._x!r})"


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    """One generation (or pooling) request as the scheduler and KV-cache manager see it.

    ``block_hasher`` (see ``get_request_block_hasher``) is called at creation and after every
    appended output token; it returns the hashes of newly completed blocks, which are appended
    to ``block_hashes``. ``pooling_params`` is any object with an optional
    ``skip_reading_prefix_cache`` attribute. ``session_id`` groups requests of one client
    session (for routing and stats); it is not part of any block hash, so sessions share cached
    prefixes.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: SamplingParams | None,
        pooling_params: Any | None,
        client_index: int = 0,
        arrival_time: float | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_is_token_ids: list[bool] | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        resumable: bool = False,
        session_id: str | None = None,
        abort_immediately: bool = False,
    ) -> None:
        if pooling_params is not None:
            self.max_tokens = 1
        elif sampling_params is not None:
            if sampling_params.max_tokens is None:
                raise ValueError("sampling_params.max_tokens: expected an int, got None")
            self.max_tokens = sampling_params.max_tokens
        else:
            raise ValueError("sampling_params and pooling_params can't both be unset")
        if prompt_token_ids is None and prompt_embeds is None:
            raise ValueError("prompt_token_ids: expected token ids or prompt_embeds, got neither")
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        extra_args = (sampling_params.extra_args if sampling_params is not None else None) or {}
        self.kv_transfer_params: dict[str, Any] | None = extra_args.get("kv_transfer_params")
        # "full": the block manager reports every cached block of the request, not only new ones.
        self.kv_cache_report_mode: str = extra_args.get("kv_cache_report_mode", "incremental")
        if self.kv_cache_report_mode not in KV_CACHE_REPORT_MODES:
            raise ValueError(
                f"kv_cache_report_mode: expected one of {KV_CACHE_REPORT_MODES}, "
                f"got {self.kv_cache_report_mode!r}"
            )
        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = prompt_embeds
        self.prompt_is_token_ids = prompt_is_token_ids
        # Digest of each block's prompt embeddings, keyed by token range (start, end).
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.num_prompt_tokens = (
            len(prompt_token_ids) if prompt_token_ids is not None else len(prompt_embeds)  # type: ignore[arg-type]
        )
        self._output_token_ids: list[int] = []
        # Embedding-only prompts have no ids; zeros hold their places (the embeddings
        # digest keys their blocks).
        self._all_token_ids: list[int] = (
            list(prompt_token_ids) if prompt_token_ids is not None else [0] * self.num_prompt_tokens
        )
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        """Tokens of steps whose output is not processed yet (async scheduling runs ahead);
        ``num_computed_tokens`` already counts them."""
        self.num_output_placeholders = 0
        self.cache_salt = cache_salt
        self.mm_features: list[MultiModalFeatureSpec] = mm_features or []
        self.trace_headers = trace_headers
        self.num_preemptions = 0
        self.resumable = resumable
        self.session_id = session_id
        self.abort_immediately = abort_immediately
        # Token position (a page boundary) of a prefix other requests were seen to share, kept
        # in a sparse prefix cache; 0: none. Set by the engine at admission.
        self.shared_prefix_boundary = 0
        self.block_hashes: list[bytes] = []
        # Kept unbound (not a bound partial) so Request -> hasher -> Request is no cycle.
        self._block_hasher = block_hasher
        self.update_block_hashes()
        self.skip_reading_prefix_cache = self.get_skip_reading_prefix_cache()

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append generated token id(s) and hash any blocks they complete."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Append the hashes of blocks completed since the last call."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_encoder_inputs(self) -> int:
        return len(self.mm_features)

    @property
    def has_encoder_inputs(self) -> bool:
        return bool(self.mm_features)

    def get_skip_reading_prefix_cache(self) -> bool:
        """Whether this request must not read cached KV (its params say so)."""
        for params in (self.sampling_params, self.pooling_params):
            skip = getattr(params, "skip_reading_prefix_cache", None)
            if skip is not None:
                return bool(skip)
        return False

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_num_encoder_embeds(self, input_id: int) -> int:
        """Embeddings of multimodal item ``input_id``."""
        if not 0 <= input_id < len(self.mm_features):
            raise IndexError(f"input_id: expected 0..{len(self.mm_features) - 1}, got {input_id}")
        return self.mm_features[input_id].mm_position.get_num_embeds()

    def __lt__(self, other: Request) -> bool:
        """Priority order: priority, then arrival time, then request id."""
        mine = (self.priority, self.arrival_time, self.request_id)
        theirs = (other.priority, other.arrival_time, other.request_id)
        if mine != theirs:
            return mine < theirs
        return id(self) < id(other)
