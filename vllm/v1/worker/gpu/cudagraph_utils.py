"""Upstream's ``vllm.v1.worker.gpu.cudagraph_utils``, reduced to the batch descriptor the
attention helpers take: the graph manager that captures and replays graphs belongs to the
engine's model runner, which this library does not ship."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config.compilation import CUDAGraphMode

__all__ = ["BatchExecutionDescriptor"]


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    """A batch's padded shape and graph mode: what a captured graph and a step must agree on.

    ``num_tokens``: tokens after padding. ``num_reqs``: requests after padding, None when the
    mode pads no requests (piecewise graphs). ``uniform_token_count``: tokens of every request
    in a uniform decode batch. ``max_query_len``: the most tokens of one request (None for a
    batch with a prefill, which keeps it out of the variable-length decode graphs).
    ``num_ubatches``: microbatches the batch is split into (1: not split)."""

    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1
