"""The end-to-end quality report of ``vllm-kv check --model``: what each KV-cache format costs a
real language model whose attention runs on the library's paged cache
(:mod:`real_kv_samples.paged_llama`).

Per format: perplexity on each shipped text (teacher-forced, prefilled in chunks through the
paged cache, every position scored), its change from the bf16 cache, top-1 agreement with the
bf16 cache at each text position, greedy-decoding agreement with the bf16 cache and with
``transformers``' own forward (tokens before the first difference, summed over the prompts),
KV bytes per token (all layers) and decode tokens/s of the prompts decoded as one batch.

Scales: the bf16 cache runs first and records every layer's post-RoPE K/V; each quantized format
then takes ``amax / MAX`` per layer from what the bf16 run recorded on the same data (the text
being scored, or the prompts and their greedy continuations), per tensor or per head as the
format says (:func:`~vllm.accuracy.formats.compute_scales`). The per-token-head formats need
none. A new format is one more :class:`~vllm.accuracy.formats.CacheFormat` in the list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from real_kv_samples.paged_llama import (
    BACKENDS,
    BLOCK_SIZE,
    KVRecorder,
    PagedKVRun,
    greedy_paged,
    reference_greedy,
    reference_scores,
    score_text,
)
from real_kv_samples.smollm2 import MODEL_NAME, PROMPTS, TEXTS, LoadedModel, load_model, load_text
from vllm.accuracy.formats import CacheFormat, parse_format

MAX_TOKENS = 1536
"""Tokens of each text scored by default (its first ones)."""

NEW_TOKENS = 48
"""Greedy tokens generated per prompt by default."""

CHUNK = 256
"""Prefill chunk, in tokens."""

REFERENCE_FORMAT = "bf16"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TextInfo:
    name: str
    title: str
    tokens: int
    transformers_perplexity: float
    """Perplexity from ``transformers``' own forward (fp32 K/V, no paged cache)."""


@dataclass(frozen=True)
class FormatResult:
    """One format's row of the report (per-text values keyed by text name)."""

    format: str
    scale_method: str
    kv_bytes_per_token: int
    perplexity: dict[str, float]
    perplexity_change: dict[str, float]
    """Relative to the bf16 cache: ``ppl / ppl_bf16 - 1``."""
    top1_vs_bf16: dict[str, float]
    top1_vs_transformers: dict[str, float]
    greedy_vs_bf16: int
    greedy_vs_transformers: int
    decode_tokens_per_s: float


@dataclass(frozen=True)
class ModelReport:
    model: str
    backend: str
    block_size: int
    chunk: int
    texts: list[TextInfo]
    prompts: int
    new_tokens: int
    rows: list[FormatResult]

    @property
    def greedy_total(self) -> int:
        return self.prompts * self.new_tokens

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {"greedy_total": self.greedy_total}

    def to_table(self) -> str:
        """The report as a text table with a short header."""
        texts = ", ".join(f"{t.name} ({t.tokens} tok: {t.title})" for t in self.texts)
        ref = ", ".join(f"{t.name} {t.transformers_perplexity:.3f}" for t in self.texts)
        head = [
            f"{self.model}, attention on the paged cache ({self.backend}, {self.block_size}-token "
            f"pages, prefill chunks of {self.chunk})",
            f"texts: {texts}",
            f"transformers' own forward (fp32 K/V): perplexity {ref}",
            f"greedy: {self.prompts} prompts x {self.new_tokens} tokens, decoded as one batch; "
            "agreement = tokens before the first difference",
        ]
        cols = ["format", "scale", "KV B/token"]
        cols += [f"ppl {t.name}" for t in self.texts]
        cols += ["greedy=bf16", "greedy=transformers", "decode tok/s"]
        body = [[*_row_cells(r, self.texts, self.greedy_total)] for r in self.rows]
        return "\n".join(head) + "\n\n" + _grid(cols, body)


def _row_cells(row: FormatResult, texts: Sequence[TextInfo], total: int) -> list[str]:
    cells = [row.format, row.scale_method, f"{row.kv_bytes_per_token:,}"]
    for t in texts:
        change = row.perplexity_change[t.name] * 100
        cells.append(f"{row.perplexity[t.name]:.3f} ({change:+.1f}%)")
    cells += [f"{row.greedy_vs_bf16}/{total}", f"{row.greedy_vs_transformers}/{total}"]
    cells.append(f"{row.decode_tokens_per_s:.1f}")
    return cells


def _grid(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def with_reference(formats: Sequence[CacheFormat]) -> list[CacheFormat]:
    """``formats`` with the bf16 cache first (added when missing: it calibrates the others and is
    what they are compared with)."""
    ref = parse_format(REFERENCE_FORMAT)
    return [ref, *(f for f in formats if f != ref)]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    differ = (a != b).nonzero()
    return int(a.numel() if differ.numel() == 0 else differ[0, 0])


@dataclass
class _Inputs:
    """Token ids and the reference results every format is compared with."""

    texts: list[tuple[TextInfo, torch.Tensor]]
    text_top1: dict[str, torch.Tensor]
    prompts: list[torch.Tensor]
    greedy: list[torch.Tensor]


def _prepare(lm: LoadedModel, max_tokens: int, new_tokens: int, prompts: int) -> _Inputs:
    texts, top1 = [], {}
    for name, title in TEXTS:
        ids = lm.encode(load_text(name))[:max_tokens]
        nll, top = reference_scores(lm, ids)
        texts.append((TextInfo(name, title, ids.numel(), math.exp(nll.mean().item())), ids))
        top1[name] = top
    prompt_ids = [lm.encode(p) for p in PROMPTS[:prompts]]
    greedy = [reference_greedy(lm, p, new_tokens) for p in prompt_ids]
    return _Inputs(texts, top1, prompt_ids, greedy)


@dataclass(frozen=True)
class _Settings:
    new_tokens: int
    chunk: int
    backend: str
    layout: str
    seed: int


@dataclass
class _Baseline:
    """What the bf16 run leaves for the others: recorded K/V per data set (a text's name, or
    ``greedy``), and its top-1 tokens, perplexities and greedy tokens."""

    recorders: dict[str, KVRecorder]
    top1: dict[str, torch.Tensor]
    perplexity: dict[str, float]
    greedy: list[torch.Tensor]

    @property
    def calibrating(self) -> bool:
        """True until the bf16 run has been recorded."""
        return not self.greedy


def _make_run(
    lm: LoadedModel,
    fmt: CacheFormat,
    key: str,
    capacities: list[int],
    base: _Baseline,
    settings: _Settings,
) -> PagedKVRun:
    """A run of ``fmt`` on data set ``key``: recording it (the bf16 run) or scaled from what the
    bf16 run recorded on it."""
    recorder, calibration = None, None
    if base.calibrating:
        recorder = base.recorders[key] = KVRecorder(lm.num_layers)
    elif fmt.is_quantized:
        calibration = base.recorders[key].calibrate(fmt, lm.key_rope())
    return PagedKVRun(
        lm,
        fmt,
        capacities,
        calibration,
        recorder,
        settings.backend,
        settings.layout,
        settings.seed,
    )


def _run_format(
    lm: LoadedModel, fmt: CacheFormat, inputs: _Inputs, base: _Baseline, settings: _Settings
) -> FormatResult:
    """One format's row; the first call (bf16) fills ``base``."""
    ppl, top1_bf16, top1_tf = {}, {}, {}
    for info, ids in inputs.texts:
        run = _make_run(lm, fmt, info.name, [ids.numel()], base, settings)
        nll, top1 = score_text(run, ids, settings.chunk)
        ppl[info.name] = math.exp(nll.mean().item())
        if base.calibrating:
            base.top1[info.name], base.perplexity[info.name] = top1, ppl[info.name]
        top1_bf16[info.name] = (top1 == base.top1[info.name]).float().mean().item()
        top1_tf[info.name] = (top1 == inputs.text_top1[info.name]).float().mean().item()
    capacities = [p.numel() + settings.new_tokens for p in inputs.prompts]
    run = _make_run(lm, fmt, "greedy", capacities, base, settings)
    generated, seconds = greedy_paged(run, inputs.prompts, settings.new_tokens)
    if base.calibrating:
        base.greedy = generated
    decoded = len(inputs.prompts) * (settings.new_tokens - 1)
    per_layer = fmt.bytes_per_token(lm.num_kv_heads, lm.head_size, lm.head_size)
    return FormatResult(
        format=fmt.name,
        scale_method=fmt.scale_method,
        kv_bytes_per_token=lm.num_layers * per_layer,
        perplexity=ppl,
        perplexity_change={k: ppl[k] / base.perplexity[k] - 1 for k in ppl},
        top1_vs_bf16=top1_bf16,
        top1_vs_transformers=top1_tf,
        greedy_vs_bf16=sum(map(_common_prefix, generated, base.greedy)),
        greedy_vs_transformers=sum(map(_common_prefix, generated, inputs.greedy)),
        decode_tokens_per_s=decoded / seconds if seconds > 0 else 0.0,
    )


def run_model_report(
    formats: Sequence[CacheFormat],
    max_tokens: int = MAX_TOKENS,
    new_tokens: int = NEW_TOKENS,
    prompts: int = len(PROMPTS),
    chunk: int = CHUNK,
    backend: str = "CPU_ATTN",
    layout: str = "NHD",
    seed: int = 0,
    progress: Progress | None = None,
) -> ModelReport:
    """Run the report for ``formats`` (bf16 is added first when missing); ``progress`` gets a
    line as each stage starts."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if new_tokens < 2:
        raise ValueError(f"new_tokens: expected at least 2 (one decode step), got {new_tokens}")
    say = progress or (lambda _text: None)
    settings = _Settings(new_tokens, chunk, backend, layout, seed)
    say(f"loading {MODEL_NAME}")
    lm = load_model()
    with torch.inference_mode():
        say("transformers' own forward (the reference)")
        inputs = _prepare(lm, max_tokens, new_tokens, prompts)
        base = _Baseline({}, {}, {}, [])
        rows = []
        for fmt in with_reference(formats):
            say(f"format {fmt.name}")
            rows.append(_run_format(lm, fmt, inputs, base, settings))
    return ModelReport(
        model=MODEL_NAME,
        backend=backend,
        block_size=BLOCK_SIZE,
        chunk=chunk,
        texts=[info for info, _ in inputs.texts],
        prompts=len(inputs.prompts),
        new_tokens=new_tokens,
        rows=rows,
    )
