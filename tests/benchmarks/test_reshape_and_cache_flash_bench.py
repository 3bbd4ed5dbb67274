"""The reshape_and_cache_flash benchmark core (vllm.benchmarks) and its script: tiny, on a CPU."""

from __future__ import annotations

import json
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.accuracy.cache_io import extension_status
from vllm.benchmarks import noise, timing
from vllm.benchmarks import reshape_and_cache_flash as core

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")
SCRIPT = (
    Path(__file__).parents[2] / "benchmarks" / "kernels" / "benchmark_reshape_and_cache_flash.py"
)


@pytest.fixture(autouse=True)
def _needs_extension() -> None:
    ok, why = extension_status()
    if not ok:
        pytest.skip(f"the benchmark needs the compiled extension: {why}")


def test_kinds_come_from_the_registry() -> None:
    assert core.KINDS == (
        "auto",
        "fp8",
        "nvfp4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
    )


def test_run_tiny() -> None:
    calls: list[tuple[int, int, str]] = []
    rows = core.run("cpu", core.KINDS, [1, 16], quick=True, progress=lambda *a: calls.append(a))
    assert [(r.kind, r.num_heads, r.num_tokens) for r in rows] == core.shapes(core.KINDS, [1, 16])
    assert len(rows) == 12
    for r in rows:
        assert r.device == "cpu" and r.mode == "cold"
        assert r.op_us > 0 and r.baseline_us > 0 and r.bytes_moved > 0
        assert r.op_gbps > 0 and r.pct_roofline > 0 and r.speedup_vs_baseline > 0
        assert r.op_gbps == pytest.approx(r.bytes_moved / r.op_us / 1e3)
        # Medians of the repeats, under the old names; each repeat paired with its own copy.
        assert r.repeats == timing.REPEATS == len(r.op_us_samples) == len(r.baseline_us_samples)
        assert r.op_us == statistics.median(r.op_us_samples)
        assert r.baseline_us == statistics.median(r.baseline_us_samples)
        assert r.speedup_vs_baseline == pytest.approx(r.baseline_us / r.op_us)
        assert r.roofline_gbps == statistics.median(r.roofline_gbps_samples) > 0
        paired = [
            100 * r.bytes_moved / us / 1e3 / gbps
            for us, gbps in zip(r.op_us_samples, r.roofline_gbps_samples, strict=True)
        ]
        assert r.pct_roofline == pytest.approx(statistics.median(paired))
        assert r.op_spread_pct == pytest.approx(noise.spread_pct(r.op_us_samples))
        assert set(r.flags) <= set(noise.FLAGS) and len(r.load_avg) == 2
    assert {r.baseline for r in rows} == {
        "index_copy_",
        "reference fp8_write_cache",
        "reference nvfp4_write_cache",
        "reference per_token_head_write_cache",
        "reference int4_per_token_head_write_cache",
    }
    # One progress call before the roofline copy, one after it, one per row; total fixed.
    assert [(d, t) for d, t, _ in calls] == [(i, 13) for i in range(14)]


def test_run_warns_on_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load average above the CPUs: one warning through ``warn``, in the JSON and under the
    table; the same run with a low load: none."""
    monkeypatch.setattr(noise.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(noise.os, "getloadavg", lambda: (9.5, 0.0, 0.0))
    warnings: list[str] = []
    rows = core.run("cpu", ["auto"], [1, 16], quick=True, repeats=2, warn=warnings.append)
    assert len(warnings) == 1 and warnings[0].startswith("warning: load average 9.50 at start")
    doc = core.to_json(rows)
    assert doc["warnings"] == warnings and doc["load"]["overloaded"]
    assert core.to_markdown(rows).splitlines()[-1] == warnings[0]
    monkeypatch.setattr(noise.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    rows = core.run("cpu", ["auto"], [1], quick=True, repeats=2, warn=warnings.append)
    assert len(warnings) == 1 and core.to_json(rows)["warnings"] == []


def test_run_warns_on_stderr_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(noise.os, "getloadavg", lambda: (1000.0, 0.0, 0.0))
    core.run("cpu", ["auto"], [1], quick=True, repeats=1)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err.startswith("warning: load average 1000.00") and captured.err.count("\n") == 1
    )


def test_run_warm_is_labelled() -> None:
    rows = core.run("cpu", ["auto"], [16], quick=True, warm=True)
    assert [r.mode for r in rows] == ["warm"]
    assert "op (µs, warm, median)" in core.to_markdown(rows).splitlines()[0]
    assert "over-roofline" not in rows[0].flags  # warm rows may pass the DRAM roofline
    doc = core.to_json(rows)
    assert doc["mode"] == "warm" and doc["flush_bytes"] is None
    assert "warm cache" in doc["mode_description"]


def test_cold_run_flushes_before_every_timed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cold: the roofline copy, the op and the baseline are each timed with a ``before`` hook
    (flush, then for the op and baseline a call on an independent copy), in that order in every
    repeat; warm: none."""
    seen: list[bool] = []
    real = timing.time_call

    def spy(fn, device, min_time_s, max_runs, before=None, warmup=True):
        seen.append(before is not None)
        return real(fn, device, min_time_s, max_runs, before, warmup)

    monkeypatch.setattr(timing, "time_call", spy)
    core.run("cpu", ["auto", "nvfp4"], [1], quick=True, repeats=2)
    assert seen == [True] * 12  # 2 shapes x 2 repeats x (roofline, op, baseline)
    seen.clear()
    core.run("cpu", ["auto"], [1], quick=True, warm=True, repeats=2)
    assert seen == [False] * 6


def test_time_call_runs_before_outside_each_call() -> None:
    events: list[str] = []
    cpu = core.torch.device("cpu")
    seconds = timing.time_call(lambda: events.append("fn"), cpu, 0.0, 3, lambda: events.append("b"))
    assert seconds >= 0
    assert events == ["b", "fn"] * 4  # warm-up + 3 timed calls
    events.clear()
    timing.time_call(lambda: events.append("fn"), cpu, 0.0, 1, warmup=False)
    assert events == ["fn"]  # a later repeat: no warm-up; max_runs 1: one call


def test_flusher_exceeds_the_last_level_cache() -> None:
    cpu = core.torch.device("cpu")
    llc = timing.last_level_cache_bytes(cpu)
    assert llc is None or llc > 0
    assert timing.flush_bytes(cpu) >= max(64 << 20, 2 * (llc or 0))
    assert timing.roofline_bytes(cpu, quick=True) >= 4 * (llc or 0)
    flusher = timing.CacheFlusher(cpu, nbytes=4096)
    flusher()
    flusher()
    assert flusher.buffer.numel() == 1024 and int(flusher.buffer.sum()) == 2 * 1024


@pytest.mark.parametrize("kind", core.KINDS)
def test_bytes_are_read_plus_written(kind: str) -> None:
    """The row counts bytes as the roofline copy does: everything read plus everything written
    (the per-token-head writers read no scale; their rows hold D + 4 bytes)."""
    s = core._setup(kind, 16, 2, core.torch.device("cpu"))
    read = sum(t.numel() * t.element_size() for t in (s.key, s.value, s.slots))
    if not core.lookup(kind).is_per_token_head:
        read += 2 * s.scale.element_size()
    row_bytes = s.key_cache[0, 0].numel() * s.key_cache.element_size()
    assert s.bytes_moved == read + 2 * 16 * row_bytes


@pytest.mark.parametrize("kind", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_op_and_baseline_write_the_same_rows(kind: str) -> None:
    """The op and its baseline (the codec's pure-torch writer) write the same cache bytes."""
    cpu = core.torch.device("cpu")
    s, ref = core._setup(kind, 40, 2, cpu), core._setup(kind, 40, 2, cpu)
    from vllm import _custom_ops as ops

    core._op(ops, kind, s)()
    name, baseline = core._baseline(kind, ref)
    baseline()
    assert name == "reference per_token_head_write_cache"
    assert s.key_cache.shape[-1] == core.HEAD_SIZE + 4
    assert core.torch.equal(s.key_cache, ref.key_cache)
    assert core.torch.equal(s.value_cache, ref.value_cache)
    assert s.key_cache.any()


def test_run_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown kinds"):
        core.run("cpu", ["int3"], [1])
    with pytest.raises(ValueError, match="positive"):
        core.run("cpu", ["auto"], [0])
    with pytest.raises(ValueError, match="repeats must be positive"):
        core.run("cpu", ["auto"], [1], repeats=0)


def test_main_writes_markdown_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The script (a wrapper of core.main): table and notes on stdout, Markdown and JSON files."""
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    argv = ["--device", "cpu", "--quick", "--kinds", "auto", "fp8", "--tokens", "16"]
    argv += ["--repeats", "3", "--markdown", str(md), "--json", str(js)]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert info.value.code == 0
    captured = capsys.readouterr()
    assert "[3/3] fp8" in captured.err  # progress on stderr
    text = md.read_text()
    assert captured.out == text
    table, notes = text.split("\n\n")
    lines = table.splitlines()
    assert len(lines) == 4 and all(line[0] == line[-1] == "|" for line in lines)
    assert {line.count("|") for line in lines} == {13}
    assert "op (µs, cold, median) | spread % |" in lines[0] and lines[0].endswith("| flags |")
    assert lines[2].startswith("| auto | 8 | 16 |") and lines[3].startswith("| fp8 | 8 | 16 |")
    assert notes.startswith("median of 3 repeats")
    doc = json.loads(js.read_text())
    assert doc["device"] == "cpu" and doc["roofline_gbps"] > 0 and doc["threads"] >= 1
    assert doc["mode"] == "cold" and doc["flush_bytes"] >= 64 << 20
    assert doc["bytes_counted"] == "read + written"
    assert doc["repeats"] == 3 and doc["spread_limit_pct"] == noise.SPREAD_LIMIT_PCT
    low, high = doc["roofline_gbps_range"]
    assert 0 < low <= doc["roofline_gbps"] <= high
    assert isinstance(doc["load"]["cores"], int) and isinstance(doc["warnings"], list)
    assert [(r["kind"], r["num_tokens"]) for r in doc["rows"]] == [("auto", 16), ("fp8", 16)]
    for r in doc["rows"]:
        assert r["op_gbps"] > 0 and len(r["op_us_samples"]) == 3
        assert isinstance(r["flags"], list) and r["op_spread_pct"] >= 0
    # Backwards compatible: every field of a row before repeats is still there, in front.
    old = ["kind", "num_tokens", "num_heads", "head_size", "device", "op_us", "baseline"]
    old += ["baseline_us", "bytes_moved", "op_gbps", "roofline_gbps", "pct_roofline"]
    assert list(doc["rows"][0])[: len(old) + 2] == [*old, "speedup_vs_baseline", "mode"]


def test_import_does_not_load_the_extension() -> None:
    """``vllm-kv`` imports every subcommand at start-up: the bench must not need the extension
    until it runs."""
    code = "import sys, vllm.cli.bench; assert 'vllm._custom_ops' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
