"""Run a ``transformers`` Llama model with its attention on the library's paged KV cache.

Every attention layer's post-RoPE K/V are written into that layer's own paged cache (pages of
16 tokens, FlashInfer-shaped ``(B, 2, N, H, D')``, in the format under test) by the ``CPU_ATTN``
backend's writer (the compiled ``reshape_and_cache_flash``), and the layer's attention is read
from the cache by the same backend (``CPUAttentionImpl.forward``, causal: a chunk's queries see
every earlier token of their sequence and themselves). Several sequences run as one flat batch,
as in an engine: the model sees ``[1, sum of new tokens]`` with each token's own position, and
the attention metadata keeps the sequences apart.

The hook is a ``transformers`` attention function registered under :data:`ATTENTION_NAME`; the
model runs it only inside :func:`paged_attention` and gets the :class:`PagedKVRun` through the
forward call's keyword arguments, so ``transformers``' own attention is untouched otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from real_kv_samples.smollm2 import LoadedModel
from vllm.accuracy.cache_io import allocate_cache
from vllm.accuracy.formats import CacheFormat, parse_format
from vllm.kv_quant import KVCacheCalibrator
from vllm.kv_quant.calibrated import KVCacheCalibration
from vllm.utils import check_positive_int
from vllm.v1.attention.backends.abstract import AttentionLayerScales
from vllm.v1.attention.backends.cpu_attn import CPUAttentionImpl, CPUAttentionMetadata
from vllm.v1.attention.backends.reference import ReferenceAttentionImpl

ATTENTION_NAME = "vllm_kv_paged"
"""The ``attn_implementation`` name of the paged-cache attention."""

BLOCK_SIZE = 16
"""Tokens per page."""

BACKENDS: tuple[str, ...] = ("CPU_ATTN", "REFERENCE")
"""Attention backends a run can read the cache with: the compiled one, or the reference
backend (fp32 throughout: ``CPU_ATTN`` weights values by softmax weights rounded to bf16)."""


class CalibrationFeed:
    """Hands the K/V a run writes (post-RoPE, with positions) to calibrators, layer ``i`` named
    ``"i"``: what an engine's calibration loop does in each attention layer."""

    def __init__(self, calibrators: Sequence[KVCacheCalibrator]) -> None:
        self.calibrators = list(calibrators)

    def observe(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        for calibrator in self.calibrators:
            calibrator.observe(str(layer), key, value, positions)


def calibrate_formats(
    lm: LoadedModel, formats: Sequence[CacheFormat], sequences: Sequence[torch.Tensor], chunk: int
) -> dict[str, KVCacheCalibration]:
    """Each quantized format's calibration (:class:`~vllm.kv_quant.KVCacheCalibrator`, layers
    ``"0"``, ``"1"``, ...; keyed by format name) from the K/V of bf16 runs over ``sequences``
    (int64 token ids, prefilled together in chunks of ``chunk`` tokens): one run per pass, every
    format's calibrator fed by the same run; keys stored before RoPE take the model's."""
    rope = lm.key_rope()
    calibrators = {
        fmt.name: KVCacheCalibrator(fmt.encoding, rope if fmt.key_prerope else None)
        for fmt in formats
        if fmt.is_quantized
    }
    longest = max((s.numel() for s in sequences), default=0)
    while pending := [c for c in calibrators.values() if not c.done]:
        feed = CalibrationFeed(pending)
        run = PagedKVRun(lm, parse_format("bf16"), [s.numel() for s in sequences], observer=feed)
        for start in range(0, longest, chunk):
            run.step([s[start : start + chunk] for s in sequences])
        for calibrator in pending:
            calibrator.finish_pass()
    return {name: c.calibration() for name, c in calibrators.items()}


class KVObserver(Protocol):
    """What sees every K/V a run writes (:class:`CalibrationFeed`)."""

    def observe(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None: ...


class PagedKVRun:
    """One run of the model on paged caches of one format: a cache and an attention impl per
    layer, one block table shared by the layers, and the sequences' lengths so far.

    ``capacities`` is the most tokens each sequence will hold; ``calibration`` the format's
    calibrated values per layer (layers ``"0"``, ``"1"``, ...; None: unit scales and no key
    offset, for bf16 and the per-token-head formats); ``observer`` sees every K/V written;
    ``backend`` is one of :data:`BACKENDS`. Each layer's impl applies the encoding's key
    transform itself (keys stored before RoPE take the model's RoPE). Unwritten cache bytes
    are seeded garbage, so a read of a wrong slot shows up.

    ``num_blocks`` (None: exactly the pages ``capacities`` need, handed out by a seeded random
    permutation) sizes each layer's cache in pages instead; then every ``block_table`` entry
    starts at 0 and the owner of the pages fills the rows and ``seq_lens`` (as
    :class:`~real_kv_samples.prefix_sharing.ManagedKVRun` does from a ``KVCacheManager``).
    ``kv_slots_written`` counts the token slots the writer filled, summed over the layers."""

    def __init__(
        self,
        lm: LoadedModel,
        fmt: CacheFormat,
        capacities: Sequence[int],
        calibration: KVCacheCalibration | None = None,
        observer: KVObserver | None = None,
        backend: str = "CPU_ATTN",
        layout: str = "NHD",
        seed: int = 0,
        num_blocks: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        names = [str(i) for i in range(lm.num_layers)]
        if calibration is not None and sorted(calibration.layers) != sorted(names):
            raise ValueError(
                f"calibration: expected layers {names[0]}..{names[-1]} (one per layer), got "
                f"{sorted(calibration.layers)}"
            )
        self.lm = lm
        self.fmt = fmt
        self.observer = observer
        self.seq_lens = [0] * len(capacities)
        self.capacities = list(capacities)
        pages = [math.ceil(c / BLOCK_SIZE) for c in capacities]
        if num_blocks is None:
            self.block_table = _block_table(pages, seed)
            num_blocks = sum(pages)
        else:
            check_positive_int("num_blocks", num_blocks)
            self.block_table = torch.zeros(len(pages), max(pages, default=0), dtype=torch.int64)
        self.kv_slots_written = 0
        self.caches = [
            allocate_cache(
                fmt, num_blocks, BLOCK_SIZE, lm.num_kv_heads, lm.head_size, layout, seed=seed + i
            )
            for i in range(lm.num_layers)
        ]
        encoding = fmt.encoding if calibration is None else calibration.encoding
        rope = lm.key_rope() if encoding.key.prerope else None
        layout_of = fmt.scale_layout_for(BLOCK_SIZE, lm.head_size)
        impl_cls = CPUAttentionImpl if backend == "CPU_ATTN" else ReferenceAttentionImpl
        self.layers, self.impls = [], []
        for name in names:
            impl = impl_cls(
                num_heads=lm.num_heads,
                head_size=lm.head_size,
                scale=lm.head_size**-0.5,  # the Llama attention's scaling
                num_kv_heads=lm.num_kv_heads,
                kv_cache_dtype=encoding,
                k_scale_layout=layout_of,
                v_scale_layout=layout_of,
                key_rope=rope,
            )
            layer = AttentionLayerScales()
            if calibration is not None:
                values = calibration.layers[name]
                layer.set_kv_scales(values.k_scale, values.v_scale)
                impl.set_key_offset(values.key_offset)
            self.layers.append(layer)
            self.impls.append(impl)
        self._metadata: CPUAttentionMetadata | None = None
        self._positions: torch.Tensor | None = None

    def step(self, new_tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """Feed ``new_tokens[i]`` (int64 ``[q_i]``, possibly empty) to sequence ``i``; returns the
        logits ``[sum q_i, vocab]`` of the new tokens, sequence by sequence."""
        if len(new_tokens) != len(self.seq_lens):
            raise ValueError(
                f"new_tokens: expected {len(self.seq_lens)} entries, got {len(new_tokens)}"
            )
        query_lens = [int(t.numel()) for t in new_tokens]
        after = [s + q for s, q in zip(self.seq_lens, query_lens, strict=True)]
        for i, (n, cap) in enumerate(zip(after, self.capacities, strict=True)):
            if n > cap:
                raise ValueError(f"new_tokens: sequence {i} would hold {n} tokens, capacity {cap}")
        spans = zip(self.seq_lens, after, strict=True)
        positions = torch.cat([torch.arange(s, n, dtype=torch.int64) for s, n in spans])
        self._metadata = CPUAttentionMetadata.build(after, query_lens, self.block_table, BLOCK_SIZE)
        self._positions = positions
        ids = torch.cat([t.to(torch.int64) for t in new_tokens])
        try:
            with paged_attention(self.lm.model):
                out = self.lm.model(
                    input_ids=ids[None], position_ids=positions[None], use_cache=False, kv_run=self
                )
        finally:
            self._metadata = self._positions = None
        self.seq_lens = after
        return out.logits[0]

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """One layer's attention: ``query [1, Hq, T, D]``, ``key`` / ``value [1, Hkv, T, D]``
        (post-RoPE) in, ``[1, T, Hq, D]`` out, K/V written into the layer's cache first."""
        assert self._metadata is not None and self._positions is not None, "inside step() only"
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        if self.observer is not None:
            self.observer.observe(layer, k, v, self._positions)
        impl, cache = self.impls[layer], self.caches[layer]
        out = impl.forward(self.layers[layer], q, k, v, cache, self._metadata)
        self.kv_slots_written += int(self._metadata.slot_mapping.numel())
        return out[None]


def _block_table(pages: Sequence[int], seed: int) -> torch.Tensor:
    """int64 ``[S, max(pages)]``: sequence ``i`` gets ``pages[i]`` distinct pages, drawn in a
    seeded random order so that logical and physical page order differ (unused entries 0)."""
    gen = torch.Generator().manual_seed(seed + 3)
    order = torch.randperm(sum(pages), generator=gen)
    table = torch.zeros(len(pages), max(pages, default=0), dtype=torch.int64)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[start : start + n]
        start += n
    return table


def _attention_function(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention interface, routed to the run passed as ``kv_run``."""
    run: PagedKVRun = kwargs["kv_run"]
    expected = run.impls[module.layer_idx].scale
    if scaling != expected:
        raise ValueError(f"scaling: expected {expected} (head_size**-0.5), got {scaling}")
    return run.attend(module.layer_idx, query, key, value), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention_function)


@contextlib.contextmanager
def paged_attention(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s attention layers run :func:`_attention_function`."""
    _register()
    before = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        model.config._attn_implementation = before


def score_text(run: PagedKVRun, ids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced pass of ``ids [N]`` through sequence 0 of ``run`` in prefill chunks of
    ``chunk`` tokens: each position's negative log-likelihood of the next token and its top-1
    token, fp32 / int64 ``[N - 1]``."""
    nll, top1 = [], []
    for start in range(0, ids.numel(), chunk):
        piece = ids[start : start + chunk]
        logits = run.step([piece])
        nll_piece, top_piece = _next_token_stats(logits, ids[start + 1 : start + 1 + chunk])
        nll.append(nll_piece)
        top1.append(top_piece)
    return torch.cat(nll), torch.cat(top1)


def _next_token_stats(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NLL of ``targets`` under the first ``len(targets)`` rows of ``logits``, and their argmax."""
    rows = logits[: targets.numel()].to(torch.float32)
    logp = torch.log_softmax(rows, dim=-1)
    return -logp.gather(1, targets[:, None])[:, 0], rows.argmax(dim=-1)


def greedy_paged(
    run: PagedKVRun, prompts: Sequence[torch.Tensor], new_tokens: int
) -> tuple[list[torch.Tensor], float]:
    """Greedy decoding of every prompt as one batch: the prompts prefilled together, then
    ``new_tokens - 1`` decode steps of one token per sequence. Returns each sequence's
    ``new_tokens`` generated ids and the seconds the decode steps took."""
    logits = run.step(list(prompts))
    ends = torch.tensor([p.numel() for p in prompts]).cumsum(0) - 1
    last = logits[ends].argmax(dim=-1)
    generated = [last]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        last = run.step(list(last[:, None])).argmax(dim=-1)
        generated.append(last)
    seconds = time.perf_counter() - start
    return list(torch.stack(generated, dim=1)), seconds


def reference_scores(lm: LoadedModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`score_text`'s numbers from ``transformers``' own forward over the whole of ``ids``
    (its eager attention on fp32 K/V, no paged cache)."""
    logits = lm.model(input_ids=ids[None], use_cache=False).logits[0]
    return _next_token_stats(logits, ids[1:])


def reference_greedy(lm: LoadedModel, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``new_tokens`` greedy ids after ``prompt`` from ``transformers``' own forward and its
    own (dynamic, fp32) KV cache."""
    # transformers 5.x renames the forward's past_key_values to cache (and the output's field).
    name = "cache" if "cache" in inspect.signature(lm.model.forward).parameters else None
    name = name or "past_key_values"
    out = lm.model(input_ids=prompt[None], use_cache=True)
    last = out.logits[0, -1].argmax()
    generated = [last]
    for _ in range(new_tokens - 1):
        past = {name: getattr(out, name)}
        out = lm.model(input_ids=last.reshape(1, 1), use_cache=True, **past)
        last = out.logits[0, -1].argmax()
        generated.append(last)
    return torch.stack(generated)
