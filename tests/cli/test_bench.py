"""``vllm-kv bench``: table, JSON, PNG and progress bar.

The rendering is tested against a stand-in benchmark module (so it runs whatever state the real
benchmark is in); the real benchmark runs once with ``--quick`` when it can be found.
"""

from __future__ import annotations

import importlib.util
import io
import json
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm.accuracy.cache_io import extension_status
from vllm.cli import bench
from vllm.cli.main import main

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason=f"--plot needs matplotlib: {bench.PLOT_HINT}",
)


@dataclass
class _Row:
    """Field names of benchmarks/kernels/benchmark_reshape_and_cache_flash.Row (a subset)."""

    kind: str
    num_tokens: int
    num_heads: int
    op_us: float
    baseline: str
    op_gbps: float
    pct_roofline: float
    speedup_vs_baseline: float


def _fake_module(calls: list[dict]) -> types.ModuleType:
    """A stand-in with the real benchmark's interface: ``run(device, kinds, tokens, quick,
    progress)`` sending one message per step, ``shapes``, ``KINDS``, ``TOKENS``."""
    mod = types.ModuleType("fake_bench")
    mod.KINDS = ("auto", "nvfp4")  # type: ignore[attr-defined]
    mod.TOKENS = (1, 16, 256)  # type: ignore[attr-defined]

    def shapes(kinds, tokens):
        return [(k, 8, t) for k in kinds for t in tokens]

    def run(device="cpu", kinds=mod.KINDS, tokens=mod.TOKENS, quick=False, progress=None):
        calls.append({"device": device, "quick": quick, "tokens": tuple(tokens)})
        report = progress or (lambda _msg: None)
        report("measuring the copy roofline ...")
        report("copy roofline: 500.0 GB/s")
        rows = []
        for kind, heads, t in shapes(kinds, tokens):
            ratio = 1.0 if kind == "auto" else 1.5
            rows.append(_Row(kind, t, heads, 10.0 + t, "index_copy_", 5.0 * t, t, ratio))
            report(f"{kind} {t}")
        return rows

    mod.shapes = shapes  # type: ignore[attr-defined]
    mod.run = run  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []
    module = _fake_module(calls)
    monkeypatch.setattr(bench, "load_benchmark_module", lambda: module)
    return calls


def test_table_and_json(fake: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--quick", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    assert fake == [{"device": "cpu", "quick": True, "tokens": bench.QUICK_TOKENS}]
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert (
        lines[0] == "reshape_and_cache_flash on cpu; roofline (device copy, same run): 500.0 GB/s"
    )
    assert lines[2].split() == [
        "kind",
        "H",
        "tokens",
        "us",
        "GB/s",
        "%",
        "roofline",
        "vs",
        "baseline",
        "baseline",
    ]
    body = [line.split() for line in lines[4:]]
    assert [(r[0], r[2]) for r in body] == [
        (k, str(t)) for k in ("auto", "nvfp4") for t in bench.QUICK_TOKENS
    ]
    assert body[4] == ["nvfp4", "8", "16", "26.00", "80.0", "16.0", "1.50x", "index_copy_"]
    # The bar went to stderr, its total from shapes(): 2 roofline steps + 6 shapes.
    assert "[" in captured.err and "8/8" in captured.err
    doc = json.loads(out.read_text())
    assert doc["tool"] == "vllm-kv bench" and doc["roofline_gbps"] == 500.0
    assert doc["rows"][0] == {
        "kind": "auto",
        "tokens": 1,
        "us": 11.0,
        "gbps": 5.0,
        "pct_roofline": 1.0,
        "baseline_ratio": 1.0,
        "heads": 8,
        "baseline": "index_copy_",
        "bytes_moved": None,
        "roofline_gbps": None,
    }


@needs_matplotlib
def test_plot_png(fake: list[dict], tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    assert main(["bench", "--quick", "--no-progress", "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_without_matplotlib(
    fake: list[dict], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "matplotlib" else real_find_spec(name, *a, **k),
    )
    assert main(["bench", "--quick", "--plot", "x.png"]) == bench.EXIT_USAGE
    err = capsys.readouterr().err
    assert "matplotlib" in err and 'pip install "vllm-kvcache[plot]"' in err
    assert fake == []  # nothing ran


def test_missing_benchmark_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def missing():
        raise bench.BenchUnavailable("the reshape_and_cache_flash benchmark was not found")

    monkeypatch.setattr(bench, "load_benchmark_module", missing)
    assert main(["bench", "--quick", "--no-progress"]) == bench.EXIT_USAGE
    assert "benchmark was not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "row",
    [
        {
            "kind": "fp8",
            "tokens": 8,
            "us": 2.0,
            "gbps": 3.0,
            "pct_roofline": 4.0,
            "baseline_ratio": 0.5,
        },
        ("fp8", 8, 2.0, 3.0, 4.0, 0.5),
    ],
)
def test_normalize_row(row: object) -> None:
    assert bench.normalize_row(row) == bench.BenchRow("fp8", 8, 2.0, 3.0, 4.0, 0.5)


def test_progress_bar_forms() -> None:
    stream = io.StringIO()
    bar = bench.ProgressBar(stream, width=10)
    bar(1, 4, "a")
    assert "[##........] 1/4" in stream.getvalue()
    bar("b")  # one more step, unknown total kept
    assert "2/4" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\n")


def test_real_benchmark_tiny(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The real benchmark, tiny: 2 kinds x 2 token counts on the CPU, through the CLI."""
    ok, why = extension_status()
    if not ok:
        pytest.skip(f"the benchmark needs the compiled extension: {why}")
    try:
        bench.load_benchmark_module()
    except bench.BenchUnavailable as e:
        pytest.skip(f"benchmark module not available: {e}")
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    argv = [
        "bench",
        "--quick",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--kinds",
        "auto",
        "nvfp4",
        "--tokens",
        "1",
        "16",
        "--json",
        str(out_json),
    ]
    plot = importlib.util.find_spec("matplotlib") is not None
    if plot:
        argv += ["--plot", str(out_png)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert "roofline (device copy, same run)" in lines[0]
    assert lines[2].split()[:3] == ["kind", "H", "tokens"]
    body = [line.split() for line in lines[4:]]
    assert [(r[0], r[2]) for r in body] == [
        ("auto", "1"),
        ("auto", "16"),
        ("nvfp4", "1"),
        ("nvfp4", "16"),
    ]
    assert "6/6" in captured.err  # roofline (2 steps) + 4 shapes
    doc = json.loads(out_json.read_text())
    assert doc["roofline_gbps"] > 0 and len(doc["rows"]) == 4
    for row in doc["rows"]:
        assert row["us"] > 0 and row["gbps"] > 0 and row["pct_roofline"] > 0
        assert row["baseline_ratio"] > 0 and row["heads"] == 8
    if plot:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert "--plot" in capsys.readouterr().out
