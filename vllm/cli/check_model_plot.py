"""The plot of ``vllm-kv check --model --plot``: each format's perplexity change on its worst
scored text against its bits per cached value, upstream's formats and the library's encodings
marked apart, the frontier of each (the least change at or under each budget) and the byte-class
goals (:data:`~real_kv_samples.lm_report.BYTE_CLASS_GOALS`). Needs matplotlib."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.accuracy.formats import parse_format

if TYPE_CHECKING:
    from real_kv_samples.lm_report import FormatResult, ModelReport

CHANGE_FLOOR = 0.0005
"""Changes at or below it (0.05%, and every gain) are drawn on it: the axis is logarithmic."""


def is_library_encoding(name: str) -> bool:
    """The format id names one of the library's own encodings (key options, or the NVFP4
    block-scale search of ``nvfp4_mse``) rather than a cache dtype upstream v0.33 has."""
    fmt = parse_format(name)
    return fmt.has_key_options or fmt.format.scale_search is True


def frontier(points: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The staircase of the least y at or under each x of ``points`` (x, y): its corners."""
    xs, ys = [], []
    for x, y in sorted(points):
        if ys and y >= ys[-1]:
            continue
        xs.append(x)
        ys.append(y)
    return xs, ys


def write_plot(report: ModelReport, path: str | Path) -> None:
    """Draw the plot (module docstring) of ``report`` to ``path`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from real_kv_samples.lm_report import BYTE_CLASS_GOALS, REFERENCE_FORMAT

    rows = [r for r in report.rows if r.format != REFERENCE_FORMAT]
    fig, ax = plt.subplots(figsize=(10, 6.5))
    groups = (
        (False, "o", "tab:blue", "upstream v0.33 cache dtypes"),
        (True, "s", "tab:orange", "this library's encodings"),
    )
    everything: list[tuple[float, float]] = []
    for ours, marker, color, label in groups:
        chosen = [r for r in rows if is_library_encoding(r.format) == ours]
        points = [(r.bits_per_value, _worst_percent(r)) for r in chosen]
        everything += points
        if not points:
            continue
        ax.scatter(*zip(*points, strict=True), marker=marker, color=color, label=label, zorder=3)
        for row, (x, y) in zip(chosen, points, strict=True):
            _annotate(ax, row.format, x, y)
        if not ours:
            ax.step(*_extended(frontier(points)), where="post", color=color, lw=1, alpha=0.6)
    ax.step(
        *_extended(frontier(everything)),
        where="post",
        color="tab:orange",
        lw=1.5,
        label="frontier of all (least change at or under each budget)",
    )
    low = 0.0
    for max_bits, goal in BYTE_CLASS_GOALS:
        ax.hlines(100 * goal, low, max_bits, colors="black", linestyles="--", lw=1)
        low = max_bits
    ax.plot([], [], "k--", lw=1, label="goal of each byte class")
    ax.set_yscale("log")
    ax.set_xlabel("bits per cached value (KV bytes per token x 8 / K and V values per token)")
    ax.set_ylabel(
        f"perplexity change over bf16 on the worst scored text, % (floor {CHANGE_FLOOR:.2%})"
    )
    texts = ", ".join(t.name for t in report.texts)
    ax.set_title(
        f"{report.model} ({report.backend}): calibrated on {report.calibration_text.name}, "
        f"scored on {texts}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
    plt.close(fig)


def _worst_percent(row: FormatResult) -> float:
    return 100 * max(row.worst_text()[1], CHANGE_FLOOR)


def _extended(corners: tuple[list[float], list[float]]) -> tuple[list[float], list[float]]:
    """A staircase's corners with its last level drawn on to 16 bits per value."""
    xs, ys = corners
    return [*xs, 16.0], [*ys, ys[-1]] if ys else []


def _annotate(ax: Any, label: str, x: float, y: float) -> None:
    ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 2), fontsize=6)
