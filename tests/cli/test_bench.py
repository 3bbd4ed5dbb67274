"""``vllm-kv bench``: table, JSON, PNG and progress bar.

The rendering is tested with the core's ``run`` replaced by a stand-in (fixed rows, so exact
output can be checked); the real benchmark runs once, tiny, through the CLI.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
import torch

from vllm.accuracy.cache_io import extension_status
from vllm.benchmarks import noise
from vllm.benchmarks import reshape_and_cache_flash as core
from vllm.cli import bench
from vllm.cli.args import EXIT_USAGE
from vllm.cli.main import main

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason=f"--plot needs matplotlib: {bench.PLOT_HINT}",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(kind: str, tokens: int, heads: int = 8, mode: str = "cold", load: float = 0.5) -> core.Row:
    """A row whose repeats spread 3% (1-token rows 0%, as given); 256-token rows flagged noisy."""
    median = 10.0 + tokens
    return core.Row(
        kind=kind,
        num_tokens=tokens,
        num_heads=heads,
        head_size=128,
        device="cpu",
        op_us=median,
        baseline="index_copy_",
        baseline_us=20.0,
        bytes_moved=1000 * tokens,
        op_gbps=5.0 * tokens,
        roofline_gbps=500.0,
        pct_roofline=float(tokens),
        speedup_vs_baseline=1.5,
        mode=mode,
        repeats=5,
        op_us_samples=[0.99 * median, median, median, median, 1.02 * median],
        op_spread_pct=3.0 if tokens > 1 else 0.0,
        roofline_gbps_samples=[500.0] * 5,
        flags=["noisy"] if tokens == 256 else [],
        load_avg=[load, load],
    )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Replace the core's ``run`` with one returning fixed rows; records its arguments."""
    calls: list[dict] = []

    def run(device, kinds, tokens, quick, progress, warm=False):
        calls.append(
            {"device": device, "kinds": list(kinds), "tokens": tokens, "quick": quick, "warm": warm}
        )
        tokens = tokens or core.QUICK_TOKENS
        total = 1 + len(kinds) * len(tokens)
        rows = []
        if progress:
            progress(0, total, "roofline")
            progress(1, total, "copy roofline: 500.0 GB/s")
        for kind in kinds:
            for t in tokens:
                rows.append(_row(kind, t, mode="warm" if warm else "cold"))
                if progress:
                    progress(1 + len(rows), total, f"{kind} {t}")
        return rows

    monkeypatch.setattr(core, "run", run)
    return calls


def test_table_and_json(fake: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--device", "cpu", "--kinds", "auto", "nvfp4", "--json", str(out)]
    assert main(argv) == 0
    assert fake == [
        {"device": "cpu", "kinds": ["auto", "nvfp4"], "tokens": None, "quick": True, "warm": False}
    ]
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == (
        "reshape_and_cache_flash on cpu, cold cache; roofline (copy, next to each row): "
        "500.0 GB/s median, 500.0-500.0"
    )
    assert lines[2].split() == [
        "kind", "H", "tokens", "median", "us", "spread", "%", "GB/s", "%", "roofline", "x",
        "baseline", "baseline", "flags",
    ]  # fmt: skip
    body = [line.split() for line in lines[4:10]]
    assert [(r[0], r[2]) for r in body] == [
        (k, str(t)) for k in ("auto", "nvfp4") for t in core.QUICK_TOKENS
    ]
    assert body[4] == ["nvfp4", "8", "16", "26.00", "3.0", "80.00", "16.0", "1.50x", "index_copy_"]
    assert body[5][-2:] == ["index_copy_", "noisy"]  # the flag column, at the 256-token rows
    # Under the table: the statistic, then the legend of the flags present (noisy only).
    assert lines[10] == "" and lines[11].startswith("median of 5 repeats")
    assert lines[12].startswith("noisy: the op's repeats spread over 25% of their median")
    assert len(lines) == 13
    assert "[" in captured.err and "7/7" in captured.err  # the bar: roofline + 6 shapes
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "reshape_and_cache_flash" and doc["roofline_gbps"] == 500.0
    assert doc["device"] == "cpu" and len(doc["rows"]) == 6
    assert doc["rows"][0]["kind"] == "auto" and doc["rows"][0]["op_gbps"] == 5.0
    assert doc["mode"] == "cold" and doc["rows"][0]["mode"] == "cold"
    assert doc["flagged_rows"] == 2 and doc["rows"][2]["flags"] == ["noisy"]
    assert doc["rows"][1]["op_spread_pct"] == 3.0 and len(doc["rows"][1]["op_us_samples"]) == 5
    assert doc["warnings"] == [] and doc["load"]["start"] == 0.5


def test_table_notes_warn_on_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load average above the CPUs at the run's start or end: the last line under the table."""
    monkeypatch.setattr(noise.os, "cpu_count", lambda: 2)
    quiet = bench.format_table([_row("auto", 16), _row("auto", 1)])
    assert "warning" not in quiet and quiet.splitlines()[-1].startswith("flags: none")
    loaded = bench.format_table([_row("auto", 16, load=2.5), _row("auto", 1)])
    assert loaded.splitlines()[-1].startswith("warning: load average 2.50 at start, 0.50 at end")


def test_default_kinds_are_every_registry_kind(fake: list[dict]) -> None:
    assert main(["bench", "--quick", "--no-progress", "--device", "cpu", "--json"]) == 0
    assert fake[0]["kinds"] == [
        "auto",
        "fp8",
        "nvfp4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
    ]


def test_warm_flag(fake: list[dict], capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--quick", "--no-progress", "--warm", "--kinds", "auto"]) == 0
    assert fake[0]["warm"] is True
    assert ", warm cache;" in capsys.readouterr().out.splitlines()[0]


@needs_matplotlib
def test_plot_png(fake: list[dict], tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    assert main(["bench", "--quick", "--no-progress", "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_plot_without_matplotlib(
    fake: list[dict], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "matplotlib" else real_find_spec(name, *a, **k),
    )
    assert main(["bench", "--quick", "--plot", "x.png"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "matplotlib" in err and 'pip install "vllm-kvcache[plot]"' in err
    assert fake == []  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--quick", "--device", "cuda"])
    assert info.value.code == EXIT_USAGE
    assert "no CUDA device" in capsys.readouterr().err


def test_progress_bar() -> None:
    stream = io.StringIO()
    bar = bench.ProgressBar(stream, width=10)
    bar(1, 5, "a")
    assert "[##........] 1/5 a" in stream.getvalue()
    bar(5, 5, "b")
    assert "[##########] 5/5 b" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\n")


def test_real_benchmark_tiny(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The real benchmark, tiny: 2 kinds x 2 token counts on the CPU, through the CLI."""
    ok, why = extension_status()
    if not ok:
        pytest.skip(f"the benchmark needs the compiled extension: {why}")
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "--quick", "--device", "cpu", "--threads", "1", "--kinds", "auto", "nvfp4"]
    argv += ["--tokens", "1", "16", "--json", str(out_json)]
    plot = importlib.util.find_spec("matplotlib") is not None
    if plot:
        argv += ["--plot", str(out_png)]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert "cold cache; roofline (copy, next to each row):" in lines[0]
    assert lines[2].split()[:7] == ["kind", "H", "tokens", "median", "us", "spread", "%"]
    body = [line.split() for line in lines[4:8]]
    assert [(r[0], r[2]) for r in body] == [
        ("auto", "1"),
        ("auto", "16"),
        ("nvfp4", "1"),
        ("nvfp4", "16"),
    ]
    assert "5/5" in captured.err  # roofline + 4 shapes
    doc = json.loads(out_json.read_text())
    assert doc["roofline_gbps"] > 0 and len(doc["rows"]) == 4
    for row, cells in zip(doc["rows"], body, strict=True):
        assert row["op_us"] > 0 and row["op_gbps"] > 0 and row["pct_roofline"] > 0
        assert row["speedup_vs_baseline"] > 0 and row["num_heads"] == 8
        assert cells[3:5] == [f"{row['op_us']:.2f}", f"{row['op_spread_pct']:.1f}"]
        assert len(row["op_us_samples"]) == doc["repeats"] and isinstance(row["flags"], list)
    assert lines[8] == "" and lines[9].startswith(f"median of {doc['repeats']} repeats")
    if plot:
        assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_help(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert "--plot" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_output_fails_before_the_run(
    fake: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture, flag: str
) -> None:
    """A missing directory, a directory as the path, or a read-only directory: exit 2 with one
    line, and the benchmark never runs."""
    if flag == "--plot" and importlib.util.find_spec("matplotlib") is None:
        pytest.skip(f"--plot needs matplotlib: {bench.PLOT_HINT}")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    cases = {
        str(tmp_path / "missing" / "out.x"): "does not exist",
        str(tmp_path): "got the directory",
    }
    if os.geteuid() != 0:  # root writes anywhere
        cases[str(read_only / "out.x")] = "is not writable"
    for path, reason in cases.items():
        with pytest.raises(SystemExit) as info:
            main(["bench", "--quick", "--no-progress", flag, path])
        assert info.value.code == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"vllm-kv bench: error: {flag}: expected")
        assert reason in err
    assert fake == []


def test_json_alone_prints_json_instead_of_the_table(
    fake: list[dict], capsys: pytest.CaptureFixture
) -> None:
    assert main(["bench", "--quick", "--no-progress", "--kinds", "auto", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "reshape_and_cache_flash" and len(doc["rows"]) == 3
