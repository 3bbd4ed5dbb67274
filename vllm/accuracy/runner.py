"""Run the accuracy check: every format over every sample, then a table or JSON.

For each sample (one layer's K/V), each format: scales from the data
(:func:`~vllm.accuracy.formats.compute_scales`), write through the chosen writer into a fresh
paged cache, optionally let ``tamper`` corrupt it (tests use this to prove the check catches
broken formats), read it back, and accumulate :mod:`vllm.accuracy.metrics` against the bf16
reference, which is the same reader's output over a bf16 cache of the same sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.accuracy.cache_io import (
    DEFAULT_BLOCK_SIZE,
    PagedCache,
    extension_status,
    has_kernel,
    make_reader,
    write_cache,
)
from vllm.accuracy.formats import CacheFormat, compute_scales
from vllm.accuracy.metrics import (
    FormatMetrics,
    MetricsAccumulator,
    cache_metrics,
    make_reference,
)
from vllm.accuracy.samples import KVSample

Tamper = Callable[[PagedCache], "PagedCache | None"]
"""Called with each written quantized cache before it is read; may corrupt its bytes in place
and/or return a changed :class:`PagedCache` (other scales or scale layouts for the reader)."""

BF16 = CacheFormat("bfloat16")


@dataclass
class FormatReport:
    """Result of one format over all samples.

    ``bytes_per_token`` is K+V bytes of one token of one layer (all KV heads). ``scales`` maps
    each sample name to its ``{"k": [...], "v": [...]}`` fp32 scales. ``per_sample`` holds the
    metrics of each sample alone; ``metrics`` aggregates them all.
    """

    fmt: CacheFormat
    bytes_per_token: int
    metrics: FormatMetrics
    per_sample: dict[str, FormatMetrics]
    scales: dict[str, dict[str, list[float]]]
    writer: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.fmt.name,
            "kv_cache_dtype": self.fmt.kv_cache_dtype,
            "scale_granularity": self.fmt.granularity,
            "scale_layout": (
                (self.fmt.scale_layout.value if self.fmt.scale_layout else "default")
                if self.fmt.is_nvfp4
                else None
            ),
            "scale_method": self.fmt.scale_method,
            "bytes_per_token": self.bytes_per_token,
            "writer": self.writer,
            "metrics": self.metrics.to_dict(),
            "per_sample": {k: m.to_dict() for k, m in self.per_sample.items()},
            "scales": self.scales,
        }


@dataclass
class CheckReport:
    """Everything ``vllm-kv check`` reports for one data source."""

    source: str
    description: str
    device: str
    seed: int
    layout: str
    block_size: int
    reader: str
    samples: list[dict[str, Any]]
    formats: list[FormatReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def get(self, name: str) -> FormatReport:
        """The report of the format with id ``name`` (e.g. ``nvfp4/head``)."""
        for rep in self.formats:
            if rep.fmt.name == name:
                return rep
        raise KeyError(f"format {name!r} not in this report")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "description": self.description,
            "device": self.device,
            "seed": self.seed,
            "layout": self.layout,
            "block_size": self.block_size,
            "reader": self.reader,
            "samples": self.samples,
            "metric_definitions": METRIC_DEFINITIONS,
            "formats": [f.to_dict() for f in self.formats],
            "notes": self.notes,
        }

    def to_table(self) -> str:
        """Readable fixed-width table with a header naming the source and the scale rules."""
        return format_table(self)


METRIC_DEFINITIONS: dict[str, str] = {
    "bytes_per_token": "K+V cache bytes of one token of one layer, all KV heads",
    "k_rel_rms": "||K_hat - K||_2 / ||K||_2 over all elements (K = bf16 reference)",
    "k_max_abs": "max |K_hat - K|, activation units",
    "v_rel_rms": "||V_hat - V||_2 / ||V||_2",
    "v_max_abs": "max |V_hat - V|",
    "out_cos_mean": "mean over query tokens of cos(O, O_ref), heads concatenated",
    "out_cos_min": "min over query tokens of cos(O, O_ref)",
    "out_rel_err": "||O - O_ref||_F / ||O_ref||_F",
    "kl_mean": (
        "mean over (query, head) of KL(softmax(qK^T/sqrt(D)) || softmax(qK_hat^T/sqrt(D))), nats"
    ),
    "kl_max": "max over (query, head) of the same KL, nats",
}


def run_check(
    samples: Sequence[KVSample],
    formats: Sequence[CacheFormat],
    *,
    source: str,
    description: str,
    writer: str = "auto",
    reader: str = "auto",
    layout: str = "NHD",
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    tamper: Tamper | None = None,
    progress: Callable[[str], None] | None = None,
) -> CheckReport:
    """Measure every format in ``formats`` over ``samples`` (see the module docstring).

    ``writer``: ``auto`` / ``op`` / ``reference``; ``reader``: ``auto`` / ``backend`` /
    ``codec``; ``layout``: ``NHD`` / ``HND``; ``seed`` picks page order and cache garbage.
    ``progress`` receives one line per (sample, format) done.
    """
    if not samples:
        raise ValueError("samples: need at least one sample")
    keyed = [f.name for f in formats if f.has_key_options]
    if keyed:
        raise ValueError(
            f"formats: expected formats without +hadamard / +offset / +prerope / +sink "
            f"(measured by the model report only), got {keyed[0]}"
        )
    rdr = make_reader(reader)
    device = str(samples[0].key.device)
    report = CheckReport(
        source=source,
        description=description,
        device=device,
        seed=seed,
        layout=layout,
        block_size=block_size,
        reader=rdr.name,
        samples=[
            {
                "name": s.name,
                "tokens": s.num_tokens,
                "sequences": len(s.seq_lens),
                "queries": int(s.query.shape[0]),
                "kv_heads": s.num_kv_heads,
                "query_heads": int(s.query.shape[1]),
                "head_size": s.head_size,
            }
            for s in samples
        ],
    )
    accs = {fmt: MetricsAccumulator() for fmt in formats}
    per_sample: dict[CacheFormat, dict[str, FormatMetrics]] = {fmt: {} for fmt in formats}
    scales: dict[CacheFormat, dict[str, dict[str, list[float]]]] = {fmt: {} for fmt in formats}
    writers: dict[CacheFormat, str] = {}
    skipped: dict[CacheFormat, str] = {}

    def write(sample: KVSample, fmt: CacheFormat) -> PagedCache:
        k_scale, v_scale = compute_scales(sample.key, sample.value, fmt)
        return write_cache(
            sample,
            fmt,
            k_scale,
            v_scale,
            writer=writer,
            layout=layout,
            block_size=block_size,
            seed=seed,
        )

    with torch.no_grad():
        for sample in samples:
            ref_cache = write(sample, BF16)
            ref = make_reference(sample, rdr.attend(ref_cache, sample.query, sample.query_lens))
            for fmt in formats:
                problem = fmt.head_size_problem(sample.head_size)
                if problem is not None:  # e.g. Octave on 32-dim heads: no row for this sample
                    skipped.setdefault(fmt, problem)
                    continue
                cache = ref_cache if fmt == BF16 else write(sample, fmt)
                if tamper is not None and fmt.is_quantized:
                    changed = tamper(cache)
                    cache = changed if changed is not None else cache
                writers[fmt] = cache.writer
                per_sample[fmt][sample.name] = cache_metrics(
                    sample, cache, rdr, ref, into=accs[fmt]
                )
                scales[fmt][sample.name] = (
                    {"k": cache.k_scale.tolist(), "v": cache.v_scale.tolist()}
                    if fmt.is_quantized and not fmt.is_per_token_head
                    else {}
                )
                if progress is not None:
                    progress(f"{sample.name}: {fmt.name}")

    no_kernel = [f.name for f in formats if f.is_quantized and not has_kernel(f) and per_sample[f]]
    if no_kernel:
        report.notes.append(
            f"writer: {', '.join(no_kernel)} written by their reference codecs (no compiled "
            "writer yet)"
        )
    if writer == "auto" and any(
        w == "reference" and has_kernel(f) for f, w in writers.items() if f.is_quantized
    ):
        ok, why = extension_status()
        reason = why if not ok else "the extension has no kernel for this device"
        report.notes.append(
            f"writer: reference codecs instead of reshape_and_cache_flash ({reason})"
        )
    for fmt, problem in skipped.items():
        missing = [s.name for s in samples if s.name not in per_sample[fmt]]
        report.notes.append(
            f"{fmt.name}: not measured on {', '.join(missing)} (the format cannot hold that "
            f"head size: {problem})"
        )
    for fmt in formats:
        if not per_sample[fmt]:
            continue
        first = next(s for s in samples if s.name in per_sample[fmt])
        report.formats.append(
            FormatReport(
                fmt=fmt,
                bytes_per_token=fmt.bytes_per_token(
                    first.num_kv_heads, first.head_size, first.head_size_v
                ),
                metrics=accs[fmt].result(),
                per_sample=per_sample[fmt],
                scales=scales[fmt],
                writer=writers[fmt],
            )
        )
    return report


def _num(x: float, digits: int = 3) -> str:
    if math.isnan(x):
        return "nan"
    if x == 0.0:
        return "0"
    if math.isinf(x):
        return "inf"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}" if abs(x) >= 1 else f"{x:.{digits + 1}f}"


def _cos(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.6f}"


def scale_rules(formats: Iterable[CacheFormat]) -> str:
    """``scales from the data: fp8_e4m3 amax(|x|)/448 per tensor; ...``: the rule of each
    quantized dtype among ``formats``, with the granularities used."""
    per_dtype: dict[str, list[CacheFormat]] = {}
    for fmt in formats:
        if fmt.is_quantized:
            per_dtype.setdefault(fmt.kv_cache_dtype, []).append(fmt)
    if not per_dtype:
        return "scales: none (unquantized formats only)"
    parts = []
    for dtype, fmts in per_dtype.items():
        if fmts[0].is_per_token_head or fmts[0].is_packed:
            parts.append(f"{dtype} {fmts[0].scale_method}")
            continue
        grans = sorted({f.granularity for f in fmts}, key=("tensor", "head").index)
        what = "global scale " if fmts[0].is_nvfp4 else ""
        per = " or per ".join(grans)
        parts.append(f"{dtype} {what}amax(|x|)/{fmts[0].scale_max_text} per {per}")
    return "scales from the data: " + "; ".join(parts)


def format_table(report: CheckReport) -> str:
    """Render ``report`` as a header plus a fixed-width table, one row per format."""
    bf16_bytes = next(
        (r.bytes_per_token for r in report.formats if not r.fmt.is_quantized),
        None,
    )
    if bf16_bytes is None and report.formats:
        s = report.samples[0]
        bf16_bytes = BF16.bytes_per_token(s["kv_heads"], s["head_size"], s["head_size"])
    headers = [
        "format",
        "scale",
        "B/token",
        "vs bf16",
        "K relRMS",
        "K maxabs",
        "V relRMS",
        "V maxabs",
        "out cos",
        "cos min",
        "out relerr",
        "KL mean",
        "KL max",
        "writer",
    ]
    rows: list[list[str]] = []
    for rep in report.formats:
        m = rep.metrics
        rows.append(
            [
                rep.fmt.name,
                rep.fmt.granularity,
                str(rep.bytes_per_token),
                f"{bf16_bytes / rep.bytes_per_token:.2f}x" if bf16_bytes else "-",
                _num(m.k_rel_rms),
                _num(m.k_max_abs),
                _num(m.v_rel_rms),
                _num(m.v_max_abs),
                _cos(m.out_cos_mean),
                _cos(m.out_cos_min),
                _num(m.out_rel_err),
                _num(m.kl_mean),
                _num(m.kl_max),
                rep.writer,
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in (0, len(cells) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    s0 = report.samples[0]
    writers = sorted({r.writer for r in report.formats})
    out = [
        f"source: {report.source} - {report.description}",
        f"samples: {len(report.samples)} x {s0['tokens']} tokens ({s0['sequences']} seqs), "
        f"{s0['kv_heads']} KV heads / {s0['query_heads']} query heads, head size "
        f"{s0['head_size']}, {s0['queries']} queries per sample",
        f"cache: {report.layout}, {report.block_size} tokens/page, device {report.device}; "
        f"writer {'/'.join(writers)}, reader {report.reader}; seed {report.seed}",
        scale_rules(r.fmt for r in report.formats),
        "errors vs bf16: relRMS = ||x_hat-x||/||x||, out = attention output, "
        "KL(p_bf16 || p_hat) of attention probabilities in nats",
        "",
        line(headers),
        line(["-" * w for w in widths]),
        *(line(r) for r in rows),
    ]
    out.extend(f"note: {n}" for n in report.notes)
    return "\n".join(out)
