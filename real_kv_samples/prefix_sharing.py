"""The real model's pages from the library's :class:`~vllm.v1.core.kv_cache_manager.KVCacheManager`,
with prefix caching: a request whose prompt starts with another one's whole pages reads them
instead of computing and writing them again.

:class:`ManagedKVRun` plans the cache of the loaded model with the library's planner
(:func:`~vllm.v1.core.kv_cache_utils.plan_kv_cache`: one full-attention group of every layer),
builds a ``KVCacheManager`` on that plan and runs a :class:`~real_kv_samples.paged_llama.PagedKVRun`
whose block-table rows are the manager's block ids. Requests are
:class:`~vllm.v1.request.Request` objects hashed by the library's request block hasher, so the
manager's ``get_computed_blocks`` finds the pages an earlier request published.
:func:`prefix_reuse_report` measures what the reuse saves on a second request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from real_kv_samples import smollm2
from real_kv_samples.paged_llama import BLOCK_SIZE, PagedKVRun, calibrate_formats
from real_kv_samples.smollm2 import LoadedModel
from vllm.accuracy.formats import CacheFormat, parse_format
from vllm.cli import args as cli_args
from vllm.cli.main import OneLineErrorParser
from vllm.config.cache import CacheConfig
from vllm.kv_quant.calibrated import KVCacheCalibration
from vllm.sampling_params import SamplingParams
from vllm.utils import check_positive_int
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.request import Request

SHARED_PREFIX = (
    "You are a careful assistant who answers questions about computers in plain words. Keep "
    "every answer short, exact and friendly, and explain any term a beginner may not know. "
    "Never guess:"
)
"""The shared start of the default prompts (written for this project; two whole pages and
part of a third in SmolLM2's tokens)."""

MAX_NEW_TOKENS = 512
"""Largest ``--new-tokens`` (as ``vllm-kv check --model``'s): the run stays short."""

Calibration = KVCacheCalibration | None
"""A format's calibrated values per layer (None: unit scales, no key offset)."""


@dataclass(frozen=True)
class PrefillStats:
    """One request's prefill: ``cached_tokens`` read from prefix-cache pages, ``tokens_prefilled``
    computed (their K/V written: ``kv_bytes_written`` bytes over all layers), in ``seconds``
    of wall time (the model's forward only)."""

    cached_tokens: int
    tokens_prefilled: int
    kv_bytes_written: int
    seconds: float


@dataclass(frozen=True)
class Prefill:
    """The logits (fp32 ``[tokens_prefilled, vocab]``) of the computed prompt tokens, and the
    prefill's numbers."""

    logits: torch.Tensor
    stats: PrefillStats


class ManagedKVRun:
    """The model on paged caches whose pages a ``KVCacheManager`` hands out.

    ``num_blocks`` pages (tokens: ``num_blocks * BLOCK_SIZE``) are planned for the format's
    ``kv_cache_dtype``; at most ``max_seqs`` requests of at most ``max_model_len`` tokens run
    at once, each in a slot of the underlying run. ``enable_caching`` turns prefix caching on
    or off; ``backend``, ``seed`` (the cache's seeded garbage) and ``calibration`` (the
    calibrated values per layer, see :func:`calibrate`) go to :class:`PagedKVRun`."""

    def __init__(
        self,
        lm: LoadedModel,
        fmt: CacheFormat,
        num_blocks: int,
        max_model_len: int,
        max_seqs: int = 2,
        enable_caching: bool = True,
        backend: str = "CPU_ATTN",
        seed: int = 0,
        calibration: Calibration = None,
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("max_model_len", max_model_len)
        check_positive_int("max_seqs", max_seqs)
        model_config = lm.model.config.to_dict()
        cache_config = CacheConfig(block_size=BLOCK_SIZE, cache_dtype=fmt.encoding.id)  # type: ignore[arg-type]
        # The plan's page must be the format's (else block ids would not index the caches the
        # run allocates): its encoding's, key sink rows included.
        page_bytes = fmt.page_bytes(lm.num_kv_heads, lm.head_size, lm.head_size, BLOCK_SIZE)
        block_bytes = page_bytes * lm.num_layers
        self.plan = kcu.plan_kv_cache(
            model_config, cache_config, num_blocks * block_bytes, max_model_len
        )
        config = self.plan.kv_cache_config
        groups = config.kv_cache_groups
        if len(groups) != 1 or len(groups[0].layer_names) != lm.num_layers:
            raise ValueError(
                f"model: expected one KV cache group of all {lm.num_layers} layers, got "
                f"{[len(g.layer_names) for g in groups]} layers per group"
            )
        if (self.plan.bytes_per_block, config.num_blocks) != (block_bytes, num_blocks):
            raise ValueError(
                f"fmt: expected the plan to give {num_blocks} pages of {block_bytes} bytes for "
                f"{fmt.name}, got {config.num_blocks} of {self.plan.bytes_per_block}"
            )
        self.manager = KVCacheManager(
            kcu.generate_scheduler_kv_cache_config([config]),
            max_model_len=max_model_len,
            hash_block_size=BLOCK_SIZE,
            enable_caching=enable_caching,
        )
        self.run = PagedKVRun(
            lm,
            fmt,
            [max_model_len] * max_seqs,
            calibration=calibration,
            backend=backend,
            seed=seed,
            num_blocks=config.num_blocks,
        )
        if not hasattr(kcu, "NONE_HASH"):
            # An engine seeds the root hash once at start-up; seeding it again would orphan
            # the pages other managers of this process already published.
            kcu.init_none_hash(sha256)
        self._block_hasher = kcu.get_request_block_hasher(BLOCK_SIZE, sha256)
        self._slots: dict[str, int] = {}
        self._requests: dict[str, Request] = {}

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one token takes over all layers: its share of a page and of the page's
        key sink rows (the plan's pages, ``plan.bytes_per_block``, hold no sink rows)."""
        lm = self.run.lm
        per_layer = self.run.fmt.bytes_per_token(lm.num_kv_heads, lm.head_size, lm.head_size)
        return lm.num_layers * per_layer

    def prefill(self, request_id: str, prompt: torch.Tensor, max_tokens: int = 16) -> Prefill:
        """Admit a request of ``prompt`` (int64 ``[T]``) and compute the prompt tokens its
        prefix-cache hit does not cover (at least the last one, for its logits).
        ``max_tokens`` bounds its generated tokens."""
        if request_id in self._requests:
            raise ValueError(f"request_id: expected a new request id, got {request_id!r}")
        capacity = self.run.capacities[0]
        if prompt.dim() != 1 or not 0 < prompt.numel() <= capacity:
            raise ValueError(
                f"prompt: expected 1 to {capacity} token ids (int64 [T]), got shape "
                f"{list(prompt.shape)}"
            )
        free = [i for i in range(len(self.run.seq_lens)) if i not in self._slots.values()]
        if not free:
            raise ValueError(
                f"max_seqs: expected a free slot for {request_id!r}, got all {len(self._slots)} "
                "holding requests"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt.tolist(),
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        hit_blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        slot = free[0]
        # Allocation first: a refused request leaves nothing registered or written.
        self._allocate(request, slot, request.num_tokens - num_hit, num_hit, hit_blocks)
        self._requests[request_id], self._slots[request_id] = request, slot
        request.num_computed_tokens = num_hit
        self.run.seq_lens[slot] = num_hit
        written = self.run.kv_slots_written
        start = time.perf_counter()
        logits = self._step(request, prompt[num_hit:])
        seconds = time.perf_counter() - start
        slots_written = self.run.kv_slots_written - written
        stats = PrefillStats(
            cached_tokens=num_hit,
            tokens_prefilled=prompt.numel() - num_hit,
            kv_bytes_written=slots_written * self.bytes_per_token // self.run.lm.num_layers,
            seconds=seconds,
        )
        return Prefill(logits, stats)

    def greedy(self, request_id: str, prefill: Prefill, new_tokens: int) -> torch.Tensor:
        """``new_tokens`` greedy ids (int64) after the request's prefill, a page allocated from
        the manager whenever a token starts one."""
        check_positive_int("new_tokens", new_tokens)
        request = self._requests[request_id]
        last = prefill.logits[-1].argmax()
        generated = [last]
        for _ in range(new_tokens - 1):
            request.append_output_token_ids(int(last))
            self._allocate(request, self._slots[request_id], 1)
            last = self._step(request, last[None])[-1].argmax()
            generated.append(last)
        return torch.stack(generated)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's pages, in order, as the manager holds them."""
        return self.manager.get_block_ids(request_id)[0]

    def free(self, request_id: str) -> None:
        """Give the request's pages back to the manager (they stay cached until evicted)."""
        self.manager.free(self._requests.pop(request_id))
        slot = self._slots.pop(request_id)
        self.run.seq_lens[slot] = 0
        self.run.block_table[slot] = 0

    def _allocate(
        self,
        request: Request,
        slot: int,
        num_new: int,
        num_hit: int = 0,
        hits: KVCacheBlocks | None = None,
    ) -> None:
        """Pages for ``num_new`` more tokens (after ``num_hit`` cached ones, ``hits``) from the
        manager, written into the slot's block-table row."""
        blocks = self.manager.allocate_slots(request, num_new, num_hit, hits)
        if blocks is None:
            raise RuntimeError(
                f"pages: expected {num_new} more tokens of request {request.request_id!r} to "
                f"fit, got {self.manager.block_pool.get_num_free_blocks()} free pages"
            )
        ids = self.block_ids(request.request_id)
        self.run.block_table[slot, : len(ids)] = torch.tensor(ids)

    def _step(self, request: Request, tokens: torch.Tensor) -> torch.Tensor:
        feed = [torch.zeros(0, dtype=torch.int64)] * len(self.run.seq_lens)
        feed[self._slots[request.request_id]] = tokens
        logits = self.run.step(feed)
        request.num_computed_tokens += tokens.numel()
        return logits


@dataclass(frozen=True)
class PrefixReuseReport:
    """The second request's prefill with the first one's pages reused and alone (caching off).
    ``same_logits``: the logits of the tokens both computed are bit-identical;
    ``max_abs_logit_diff`` their largest difference; ``same_greedy_tokens``: the decoded ids
    agree."""

    shared_tokens: int
    with_reuse: PrefillStats
    without_reuse: PrefillStats
    same_logits: bool
    max_abs_logit_diff: float
    same_greedy_tokens: bool

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields (seconds, tokens, bytes)."""
        return asdict(self)


def shared_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading tokens ``a`` and ``b`` have in common."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


def calibrate(lm: LoadedModel, fmt: CacheFormat, prompts: Sequence[torch.Tensor]) -> Calibration:
    """``fmt``'s calibrated values from the K/V of a bf16 pass over ``prompts`` prefilled as
    one batch (:func:`~real_kv_samples.paged_llama.calibrate_formats`); None for the
    unquantized cache."""
    if not fmt.is_quantized:
        return None
    return calibrate_formats(lm, [fmt], prompts, max(p.numel() for p in prompts))[fmt.name]


def shared_prefix_prompts(lm: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts (int64 token ids) that start with :data:`SHARED_PREFIX` and go on with
    different questions; joined as ids, so the prefix is the same ids in both."""
    prefix = lm.encode(SHARED_PREFIX)
    first = torch.cat([prefix, lm.encode(" " + smollm2.PROMPTS[3])])
    second = torch.cat([prefix, lm.encode(" " + smollm2.PROMPTS[0])])
    return first, second


def prefix_reuse_report(
    lm: LoadedModel,
    fmt: CacheFormat,
    first: torch.Tensor,
    second: torch.Tensor,
    new_tokens: int = 4,
    calibration: Calibration = None,
) -> PrefixReuseReport:
    """Prefill ``first`` then ``second`` (int64 token ids) on one managed run, and ``second``
    alone on a run without prefix caching; greedy-decode ``new_tokens`` of each second.
    ``calibration``: the format's calibrated values (see :func:`calibrate`)."""
    max_model_len = max(first.numel(), second.numel()) + new_tokens
    pages = 2 * -(-max_model_len // BLOCK_SIZE) + 1  # both requests, plus the null page
    results = []
    for caching in (True, False):
        managed = ManagedKVRun(
            lm, fmt, pages, max_model_len, enable_caching=caching, calibration=calibration
        )
        if caching:
            managed.greedy("first", managed.prefill("first", first, new_tokens), new_tokens)
        prefill = managed.prefill("second", second, new_tokens)
        results.append((prefill, managed.greedy("second", prefill, new_tokens)))
    (reused, reused_ids), (alone, alone_ids) = results
    # The reused run computed only the tail of the prompt: compare those rows.
    alone_rows = alone.logits[alone.logits.shape[0] - reused.logits.shape[0] :]
    return PrefixReuseReport(
        shared_tokens=shared_prefix_len(first, second),
        with_reuse=reused.stats,
        without_reuse=alone.stats,
        same_logits=bool(torch.equal(reused.logits, alone_rows)),
        max_abs_logit_diff=float((reused.logits - alone_rows).abs().max()),
        same_greedy_tokens=bool(torch.equal(reused_ids, alone_ids)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m real_kv_samples.prefix_sharing [--format F] [--new-tokens N]``: the report of
    :func:`prefix_reuse_report` on :func:`shared_prefix_prompts`, as JSON on stdout. A bad
    argument or a missing model package is one line on stderr, exit status 2, before the model
    is loaded (the rule of ``vllm-kv``, whose parser and argument types this uses)."""
    parser = OneLineErrorParser(
        prog="python -m real_kv_samples.prefix_sharing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--format",
        type=cli_args.parsed_by(parse_format, "formats"),
        default="bf16",
        help="cache format, a format id of vllm-kv check (default bf16)",
    )
    parser.add_argument(
        "--new-tokens",
        type=cli_args.int_in_range(1, MAX_NEW_TOKENS, f"an integer from 1 to {MAX_NEW_TOKENS}"),
        default=4,
        help="greedy tokens (default 4)",
    )
    args = parser.parse_args(argv)
    fmt: CacheFormat = args.format
    try:
        smollm2.model_file()
    except smollm2.MissingModelError as exc:
        parser.error(f"the model {exc}")
    lm = smollm2.load_model()
    with torch.inference_mode():
        prompts = shared_prefix_prompts(lm)
        calibration = calibrate(lm, fmt, prompts)
        report = prefix_reuse_report(lm, fmt, *prompts, args.new_tokens, calibration)
    print(json.dumps({"format": fmt.name, **report.as_dict()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
