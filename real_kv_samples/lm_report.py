"""The end-to-end quality report of ``vllm-kv check --model``: what each KV-cache format costs a
real language model whose attention runs on the library's paged cache
(:mod:`real_kv_samples.paged_llama`).

Per format: perplexity on each scored text (teacher-forced, prefilled in chunks through the
paged cache, every position scored), its change from the bf16 cache, top-1 agreement with the
bf16 cache at each text position, greedy-decoding agreement with the bf16 cache and with
``transformers``' own forward (tokens before the first difference, summed over the prompts),
KV bytes per token (all layers, every byte a page holds) and bits per cached value, and decode
tokens/s of the prompts decoded as one batch. Then, per byte class (bits per value at most
3.5, 4.75, 6.5, 8.5), the format with the smallest change on its worst text, against the
class's goal (:data:`BYTE_CLASS_GOALS`).

Held out: every format is calibrated once, before anything is scored, on a calibration text that
is never scored (the shipped ``assignment`` chapter, or the caller's), as an engine calibrates
offline: bf16 runs over it feed one :class:`~vllm.kv_quant.KVCacheCalibrator` per format
(scales ``amax / MAX`` per tensor or per head, the key offset of ``+offset``, keys before RoPE
for ``+prerope``), and that calibration serves every scored text and the greedy prompts.
Formats that read no scale (per-token-head, packed K+V slots) get ones. A new format is one
more :class:`~vllm.accuracy.formats.CacheFormat` in the list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from real_kv_samples.paged_llama import (
    BACKENDS,
    BLOCK_SIZE,
    PagedKVRun,
    calibrate_formats,
    greedy_paged,
    reference_greedy,
    reference_scores,
    score_text,
)
from real_kv_samples.smollm2 import (
    MODEL_NAME,
    PROMPTS,
    LoadedModel,
    Text,
    calibration_text,
    load_model,
    scored_texts,
)
from vllm.accuracy.formats import CacheFormat, parse_format
from vllm.kv_quant.calibrated import KVCacheCalibration

MAX_TOKENS = 1536
"""Tokens of each text scored, and of the calibration text, by default (their first ones)."""

NEW_TOKENS = 48
"""Greedy tokens generated per prompt by default."""

CHUNK = 256
"""Prefill chunk, in tokens."""

REFERENCE_FORMAT = "bf16"

BYTE_CLASS_GOALS: tuple[tuple[float, float], ...] = (
    (3.5, 0.05),
    (4.75, 0.02),
    (6.5, 0.005),
    (8.5, 0.002),
)
"""The project's accuracy goals: (most bits per cached value, largest perplexity change over the
bf16 cache on the worst scored text) of each byte class."""

Progress = Callable[[str], None]


class ShortTextError(ValueError):
    """A text has too few tokens to run: ``role`` is ``"text"`` (scored) or ``"calibration
    text"``."""

    def __init__(self, role: str, message: str) -> None:
        super().__init__(message)
        self.role = role


@dataclass(frozen=True)
class TextInfo:
    name: str
    title: str
    tokens: int
    transformers_perplexity: float
    """Perplexity from ``transformers``' own forward (fp32 K/V, no paged cache)."""


@dataclass(frozen=True)
class CalibrationInfo:
    """The text every format was calibrated on (never scored)."""

    name: str
    title: str
    tokens: int


@dataclass(frozen=True)
class FormatResult:
    """One format's row of the report (per-text values keyed by text name)."""

    format: str
    scale_method: str
    kv_bytes_per_token: int
    bits_per_value: float
    """``kv_bytes_per_token`` in bits over the K and V values a token caches (all layers)."""
    perplexity: dict[str, float]
    perplexity_change: dict[str, float]
    """Relative to the bf16 cache: ``ppl / ppl_bf16 - 1``."""
    top1_vs_bf16: dict[str, float]
    top1_vs_transformers: dict[str, float]
    greedy_vs_bf16: int
    greedy_vs_transformers: int
    decode_tokens_per_s: float

    def worst_text(self) -> tuple[str, float]:
        """The scored text with the largest perplexity change, and that change."""
        name = max(self.perplexity_change, key=lambda k: self.perplexity_change[k])
        return name, self.perplexity_change[name]


@dataclass(frozen=True)
class ByteClass:
    """One byte class of the report: its goal and the format that comes closest (the smallest
    change on its worst text among the quantized rows of at most ``max_bits`` per value)."""

    max_bits: float
    goal: float
    best_format: str | None
    """None when no row is in the class."""
    bits_per_value: float | None
    worst_text: str | None
    worst_change: float | None

    @property
    def met(self) -> bool:
        return self.worst_change is not None and self.worst_change <= self.goal


@dataclass(frozen=True)
class ModelReport:
    model: str
    backend: str
    block_size: int
    chunk: int
    calibration_text: CalibrationInfo
    texts: list[TextInfo]
    prompts: int
    new_tokens: int
    rows: list[FormatResult]

    @property
    def greedy_total(self) -> int:
        return self.prompts * self.new_tokens

    def byte_classes(self) -> list[ByteClass]:
        """Each class of :data:`BYTE_CLASS_GOALS` with its best row (the bf16 cache aside)."""
        out = []
        for max_bits, goal in BYTE_CLASS_GOALS:
            rows = [
                r
                for r in self.rows
                if r.format != REFERENCE_FORMAT and r.bits_per_value <= max_bits
            ]
            best = min(rows, key=lambda r: r.worst_text()[1], default=None)
            if best is None:
                out.append(ByteClass(max_bits, goal, None, None, None, None))
                continue
            out.append(
                ByteClass(max_bits, goal, best.format, best.bits_per_value, *best.worst_text())
            )
        return out

    def to_dict(self) -> dict[str, object]:
        classes = [asdict(c) | {"met": c.met} for c in self.byte_classes()]
        return asdict(self) | {"greedy_total": self.greedy_total, "byte_classes": classes}

    def to_table(self) -> str:
        """The report as a text table with a short header, then the byte classes."""
        texts = ", ".join(f"{t.name} ({t.tokens} tok: {t.title})" for t in self.texts)
        ref = ", ".join(f"{t.name} {t.transformers_perplexity:.3f}" for t in self.texts)
        cal = self.calibration_text
        head = [
            f"{self.model}, attention on the paged cache ({self.backend}, {self.block_size}-token "
            f"pages, prefill chunks of {self.chunk})",
            f"calibrated on: {cal.name} ({cal.tokens} tok: {cal.title}), never scored",
            f"scored texts: {texts}",
            f"transformers' own forward (fp32 K/V): perplexity {ref}",
            f"greedy: {self.prompts} prompts x {self.new_tokens} tokens, decoded as one batch; "
            "agreement = tokens before the first difference",
        ]
        cols = ["format", "scale", "KV B/token", "bits/value"]
        cols += [f"ppl {t.name}" for t in self.texts]
        cols += ["greedy=bf16", "greedy=transformers", "decode tok/s"]
        body = [[*_row_cells(r, self.texts, self.greedy_total)] for r in self.rows]
        classes = [
            ["bits/value", "goal (worst text)", "closest format", "bits/value", "worst text"]
        ]
        for c in self.byte_classes():
            if c.best_format is None:
                classes.append([f"<= {c.max_bits:g}", f"<= {c.goal:+.1%}", "(no format)", "", ""])
                continue
            assert c.worst_change is not None and c.bits_per_value is not None
            verdict = "met" if c.met else f"{c.worst_change - c.goal:+.2%} short"
            classes.append(
                [
                    f"<= {c.max_bits:g}",
                    f"<= {c.goal:+.1%}",
                    c.best_format,
                    f"{c.bits_per_value:.2f}",
                    f"{c.worst_text} {c.worst_change:+.2%} ({verdict})",
                ]
            )
        return (
            "\n".join(head)
            + "\n\n"
            + _grid(cols, body)
            + "\n\nbyte classes (held out):\n"
            + _grid(classes[0], classes[1:])
        )


def _row_cells(row: FormatResult, texts: Sequence[TextInfo], total: int) -> list[str]:
    cells = [
        row.format,
        row.scale_method,
        f"{row.kv_bytes_per_token:,}",
        f"{row.bits_per_value:.2f}",
    ]
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
    """``formats`` with the bf16 cache first (added when missing: it is what the others are
    compared with)."""
    ref = parse_format(REFERENCE_FORMAT)
    return [ref, *(f for f in formats if f != ref)]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    differ = (a != b).nonzero()
    return int(a.numel() if differ.numel() == 0 else differ[0, 0])


def _tokens(lm: LoadedModel, text: Text, max_tokens: int, role: str) -> torch.Tensor:
    """The first ``max_tokens`` token ids of ``text``; :class:`ShortTextError` under 2."""
    ids = lm.encode(text.content)[:max_tokens]
    if ids.numel() < 2:
        raise ShortTextError(role, f"{text.title}: expected at least 2 tokens, got {ids.numel()}")
    return ids


@dataclass
class _Inputs:
    """Token ids and the reference results every format is compared with."""

    calibration: tuple[CalibrationInfo, torch.Tensor]
    texts: list[tuple[TextInfo, torch.Tensor]]
    text_top1: dict[str, torch.Tensor]
    prompts: list[torch.Tensor]
    greedy: list[torch.Tensor]


def _prepare(
    lm: LoadedModel,
    texts: Sequence[Text],
    calibration: Text,
    max_tokens: int,
    new_tokens: int,
    prompts: int,
) -> _Inputs:
    cal_ids = _tokens(lm, calibration, max_tokens, "calibration text")
    cal_info = CalibrationInfo(calibration.name, calibration.title, cal_ids.numel())
    scored, top1 = [], {}
    for text in texts:
        ids = _tokens(lm, text, max_tokens, "text")
        nll, top = reference_scores(lm, ids)
        info = TextInfo(text.name, text.title, ids.numel(), math.exp(nll.mean().item()))
        scored.append((info, ids))
        top1[text.name] = top
    prompt_ids = [lm.encode(p) for p in PROMPTS[:prompts]]
    greedy = [reference_greedy(lm, p, new_tokens) for p in prompt_ids]
    return _Inputs((cal_info, cal_ids), scored, top1, prompt_ids, greedy)


@dataclass(frozen=True)
class _Settings:
    new_tokens: int
    chunk: int
    backend: str
    layout: str
    seed: int


@dataclass
class _Baseline:
    """What the bf16 run leaves for the others: its top-1 tokens and perplexity per text and
    its greedy tokens."""

    top1: dict[str, torch.Tensor]
    perplexity: dict[str, float]
    greedy: list[torch.Tensor]

    @property
    def pending(self) -> bool:
        """True until the bf16 run has filled it."""
        return not self.greedy


def _run_format(
    lm: LoadedModel,
    fmt: CacheFormat,
    calibration: KVCacheCalibration | None,
    inputs: _Inputs,
    base: _Baseline,
    settings: _Settings,
) -> FormatResult:
    """One format's row with its ``calibration`` (None for bf16); the first call (bf16) fills
    ``base``."""

    def make_run(capacities: list[int]) -> PagedKVRun:
        return PagedKVRun(
            lm,
            fmt,
            capacities,
            calibration,
            backend=settings.backend,
            layout=settings.layout,
            seed=settings.seed,
        )

    ppl, top1_bf16, top1_tf = {}, {}, {}
    for info, ids in inputs.texts:
        nll, top1 = score_text(make_run([ids.numel()]), ids, settings.chunk)
        ppl[info.name] = math.exp(nll.mean().item())
        if base.pending:
            base.top1[info.name], base.perplexity[info.name] = top1, ppl[info.name]
        top1_bf16[info.name] = (top1 == base.top1[info.name]).float().mean().item()
        top1_tf[info.name] = (top1 == inputs.text_top1[info.name]).float().mean().item()
    run = make_run([p.numel() + settings.new_tokens for p in inputs.prompts])
    generated, seconds = greedy_paged(run, inputs.prompts, settings.new_tokens)
    if base.pending:
        base.greedy = generated
    decoded = len(inputs.prompts) * (settings.new_tokens - 1)
    per_layer = fmt.bytes_per_token(lm.num_kv_heads, lm.head_size, lm.head_size)
    values = lm.num_layers * lm.num_kv_heads * 2 * lm.head_size
    return FormatResult(
        format=fmt.name,
        scale_method=fmt.scale_method,
        kv_bytes_per_token=lm.num_layers * per_layer,
        bits_per_value=8 * lm.num_layers * per_layer / values,
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
    texts: Sequence[Text] | None = None,
    calibration: Text | None = None,
    max_tokens: int = MAX_TOKENS,
    new_tokens: int = NEW_TOKENS,
    prompts: int = len(PROMPTS),
    chunk: int = CHUNK,
    backend: str = "CPU_ATTN",
    layout: str = "NHD",
    seed: int = 0,
    progress: Progress | None = None,
) -> ModelReport:
    """Run the report for ``formats`` (bf16 is added first when missing) on ``texts`` (default:
    the shipped ones), each format calibrated on ``calibration`` (default: the shipped
    calibration text; never scored); ``progress`` gets a line as each stage starts.
    :class:`ShortTextError` for a text of fewer than 2 tokens."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if new_tokens < 2:
        raise ValueError(f"new_tokens: expected at least 2 (one decode step), got {new_tokens}")
    texts = scored_texts() if texts is None else list(texts)
    calibration = calibration_text() if calibration is None else calibration
    names = [t.name for t in texts]
    if not texts or len(set(names)) != len(names):
        raise ValueError(f"texts: expected texts of distinct names, got {names}")
    say = progress or (lambda _text: None)
    settings = _Settings(new_tokens, chunk, backend, layout, seed)
    say(f"loading {MODEL_NAME}")
    lm = load_model()
    formats = with_reference(formats)
    with torch.inference_mode():
        say("transformers' own forward (the reference)")
        inputs = _prepare(lm, texts, calibration, max_tokens, new_tokens, prompts)
        cal_info, cal_ids = inputs.calibration
        say(f"calibrating on {cal_info.name} ({cal_info.tokens} tokens)")
        calibrations = calibrate_formats(lm, formats, [cal_ids], chunk)
        base = _Baseline({}, {}, [])
        rows = []
        for fmt in formats:
            say(f"format {fmt.name}")
            calibrated = calibrations.get(fmt.name)
            rows.append(_run_format(lm, fmt, calibrated, inputs, base, settings))
    return ModelReport(
        model=MODEL_NAME,
        backend=backend,
        block_size=BLOCK_SIZE,
        chunk=chunk,
        calibration_text=cal_info,
        texts=[info for info, _ in inputs.texts],
        prompts=len(inputs.prompts),
        new_tokens=new_tokens,
        rows=rows,
    )
