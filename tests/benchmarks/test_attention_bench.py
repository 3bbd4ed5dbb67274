"""The attention benchmark (``vllm-kv bench --op attention``) on tiny shapes: rows, ratios,
table, JSON, PNG and the argument errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vllm.benchmarks import attention
from vllm.cli import bench
from vllm.cli.main import main

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "QUICK_DECODE_SHAPES", ((2, 48),))
    monkeypatch.setattr(attention, "QUICK_PREFILL_SHAPES", ((8, 40),))


def test_bytes_moved_counts_cache_and_io() -> None:
    # bf16: 2 sides x 8 heads x 128 x 2 bytes per token; NVFP4: F(128) = 72 bytes per head.
    assert attention.cache_bytes_per_token("auto") == 4096
    assert attention.cache_bytes_per_token("fp8") == 2048
    assert attention.cache_bytes_per_token("nvfp4") == 1152
    io = 2 * 3 * 32 * 128 * 2
    assert attention.bytes_moved("nvfp4", 3, 1, 100) == 3 * 100 * 1152 + io


def test_run_rows(tiny: None) -> None:
    seen: list[str] = []
    rows = attention.run(["nvfp4", "auto"], quick=True, progress=lambda d, t, m: seen.append(m))
    assert [(r.phase, r.format, r.batch, r.query_tokens, r.context) for r in rows] == [
        ("decode", "auto", 2, 1, 48),
        ("decode", "nvfp4", 2, 1, 48),
        ("prefill", "auto", 1, 8, 40),
        ("prefill", "nvfp4", 1, 8, 40),
    ]
    assert len(seen) == 1 + 1 + len(rows) and "copy roofline" in seen[1]
    for r in rows:
        assert r.op_us > 0 and r.roofline_gbps > 0 and r.speedup_vs_reference > 0
        assert r.pct_roofline == pytest.approx(100 * r.op_gbps / r.roofline_gbps)
    assert rows[0].time_vs_bf16 == 1.0
    assert rows[1].time_vs_bf16 == pytest.approx(rows[1].op_us / rows[0].op_us)
    with pytest.raises(ValueError, match=r"formats: unknown \['int4'\]"):
        attention.run(["int4"])


def test_cli_table_json_plot(tiny: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_json = tmp_path / "a.json"
    argv = ["bench", "--op", "attention", "--quick", "--no-progress", "--kinds", "auto", "fp8"]
    argv += ["--json", str(out_json)]
    plot = importlib.util.find_spec("matplotlib") is not None
    if plot:
        argv += ["--plot", str(tmp_path / "a.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU_ATTN on cpu (1 threads), cold cache; roofline")
    assert "decode   fp8" in out and "time/bf16" in out
    data = json.loads(out_json.read_text())
    assert data["benchmark"] == "attention" and data["model"]["num_kv_heads"] == 8
    assert [r["format"] for r in data["rows"]] == ["auto", "fp8", "auto", "fp8"]
    if plot:
        assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_cache_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--op", "attention", "--tokens", "4"]) == bench.EXIT_USAGE
    assert "--tokens: not used by --op attention" in capsys.readouterr().err
    assert main(["bench", "--op", "attention", "--device", "cuda"]) == bench.EXIT_USAGE
