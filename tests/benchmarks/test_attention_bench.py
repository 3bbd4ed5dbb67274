"""The attention benchmark (``vllm-kv bench --op attention``) on tiny shapes: rows, ratios,
table, JSON, PNG and the argument errors."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch

from vllm.benchmarks import attention, noise, timing
from vllm.cli.main import main

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")
USAGE = 2
"""vllm-kv's exit status for a bad argument."""


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
        assert r.repeats == timing.REPEATS == len(r.op_us_samples) == len(r.baseline_us_samples)
        assert r.op_us == statistics.median(r.op_us_samples)
        assert r.reference_us == statistics.median(r.baseline_us_samples)
        paired = [
            100 * r.bytes_moved / us / 1e3 / gbps
            for us, gbps in zip(r.op_us_samples, r.roofline_gbps_samples, strict=True)
        ]
        assert r.pct_roofline == pytest.approx(statistics.median(paired))
        assert set(r.flags) <= set(noise.FLAGS)
    assert rows[0].time_vs_bf16 == 1.0
    assert rows[1].time_vs_bf16 == pytest.approx(rows[1].op_us / rows[0].op_us)
    with pytest.raises(ValueError, match="formats: unknown KV-cache dtype 'int4'"):
        attention.run(["int4"])
    with pytest.raises(ValueError, match="or an encoding id with key options .* got 'nvfp4/head'"):
        attention.run(["nvfp4/head"])


def test_key_option_rows(tiny: None) -> None:
    """Encodings with key options: their bytes count the sink rows, their caches come from their
    own writer (valid pages: finite outputs), and their time is compared with the base format's
    at the same shape when it ran too."""
    pre = "nvfp4_mse+offset+prerope+sink"
    assert attention.cache_bytes_per_token(pre) == 1152 + 8 * 128 // 16  # + one sink row a page
    assert attention.base_kind(attention.transform_encoding(pre)) == "nvfp4"
    rows = attention.run(["nvfp4", pre, "fp8_e4m3/head+hadamard+offset"], quick=True, repeats=2)
    assert [r.format for r in rows[:3]] == ["nvfp4", pre, "fp8_e4m3/head+hadamard+offset"]
    nvfp4, rebuilt, fp8 = rows[:3]
    assert nvfp4.time_vs_base is None and fp8.time_vs_base is None  # no fp8 row ran
    assert rebuilt.time_vs_base == pytest.approx(rebuilt.op_us / nvfp4.op_us)
    problem = attention._problem(pre, 2, 1, 48)
    out = problem.impl.forward(
        problem.layer, problem.query, None, None, problem.kv_cache, problem.metadata
    )
    assert torch.isfinite(out).all()


def test_attention_runs_one_thread_on_a_contended_machine(monkeypatch) -> None:
    from vllm.cli import bench

    monkeypatch.setattr(noise, "cpu_count", lambda: 2)
    monkeypatch.setattr(noise, "load_average", lambda: 2.5)
    assert bench.default_threads() == 1
    monkeypatch.setattr(noise, "load_average", lambda: 0.4)
    assert bench.default_threads() is None
    monkeypatch.setattr(noise, "load_average", lambda: None)
    assert bench.default_threads() is None
    with pytest.raises(ValueError, match="repeats must be positive"):
        attention.run(["auto"], repeats=0)


def test_reference_only_on_small_shapes(tiny: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above REFERENCE_MAX_TOKENS no reference is timed: no ratio, no baseline samples, and no
    noisy-baseline flag."""
    monkeypatch.setattr(attention, "REFERENCE_MAX_TOKENS", 50)
    rows = attention.run(["auto"], quick=True, repeats=2)
    assert [r.speedup_vs_reference is None for r in rows] == [True, False]
    assert rows[0].baseline_us_samples is None and rows[0].baseline_spread_pct is None
    assert "noisy-baseline" not in rows[0].flags
    assert len(rows[1].baseline_us_samples) == 2


def test_cli_table_json_plot(tiny: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_json = tmp_path / "a.json"
    argv = ["bench", "--op", "attention", "--quick", "--no-progress", "--kinds", "auto", "fp8"]
    argv += ["--json", str(out_json)]
    plot = importlib.util.find_spec("matplotlib") is not None
    if plot:
        argv += ["--plot", str(tmp_path / "a.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "CPU_ATTN on cpu (1 threads), cold cache, pages of 16 tokens; roofline (copy, next to each"
    )
    assert "decode   fp8" in out and "time/bf16" in out
    lines = out.splitlines()
    assert lines[2].split()[5:9] == ["median", "us", "spread", "%"]
    assert lines[2].split()[-1] == "flags"
    body = [line.split() for line in lines[4:8]]
    data = json.loads(out_json.read_text())
    for cells, r in zip(body, data["rows"], strict=True):
        assert cells[5:7] == [f"{r['op_us']:.1f}", f"{r['op_spread_pct']:.1f}"]
        assert cells[12:] == ([",".join(r["flags"])] if r["flags"] else [])
    assert lines[8] == "" and lines[9].startswith("median of 5 repeats")
    assert data["benchmark"] == "attention" and data["model"]["num_kv_heads"] == 8
    assert [r["format"] for r in data["rows"]] == ["auto", "fp8", "auto", "fp8"]
    assert data["repeats"] == 5 and "flag_legend" in data and "load" in data
    assert data["roofline_gbps"] == statistics.median(
        g for r in data["rows"] for g in r["roofline_gbps_samples"]
    )
    if plot:
        assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pages_of_another_size(tiny: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--block-size: the problems' pages, the bytes counted (an encoding's sink rows shared by
    the page's tokens), the rows, the title and the JSON."""
    pre = "nvfp4_mse+offset+prerope+sink"
    assert attention.cache_bytes_per_token(pre, 64) == 1152 + 8 * 128 // 64
    assert attention.bytes_moved("auto", 2, 1, 48, 64) == attention.bytes_moved("auto", 2, 1, 48)
    problem = attention._problem("fp8", 2, 1, 100, 64)
    assert problem.kv_cache.shape[0] == 2 * 2 and problem.metadata.block_table.shape == (2, 2)
    out_json = tmp_path / "a.json"
    argv = ["bench", "--op", "attention", "--quick", "--no-progress", "--kinds", "auto", pre]
    assert main([*argv, "--block-size", "64", "--json", str(out_json)]) == 0
    assert "cold cache, pages of 64 tokens;" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["model"]["block_size"] == 64
    assert {r["block_size"] for r in data["rows"]} == {64}
    rebuilt = next(r for r in data["rows"] if r["format"] == pre)
    assert rebuilt["bytes_moved"] == attention.bytes_moved(pre, 2, 1, 48, 64)
    with pytest.raises(ValueError, match="block_size: expected a positive number of tokens, got 0"):
        attention.run(["auto"], quick=True, block_size=0)


def _exit_status(argv: list[str]) -> int | str | None:
    """``main``'s status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_cli_rejects_cache_options(capsys: pytest.CaptureFixture) -> None:
    assert _exit_status(["bench", "--op", "attention", "--tokens", "4"]) == USAGE
    assert "--tokens: not used by --op attention" in capsys.readouterr().err
    assert _exit_status(["bench", "--op", "attention", "--device", "cuda"]) == USAGE


def _check_problem_matches_reference(kind: str) -> None:
    """The benchmark's problem of ``kind`` is finite and CPU_ATTN reads it as REFERENCE does."""
    problem = attention._problem(kind, 2, 3, 40)
    args = (problem.layer, problem.query, None, None, problem.kv_cache, problem.metadata)
    got, want = problem.impl.forward(*args), problem.reference.forward(*args)
    assert bool(got.isfinite().all())
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_run_reads_per_token_head_caches(tiny: None) -> None:
    """The per-token-head kinds run too (rows with random values and finite inline scales), their
    bytes counting the 4-byte scale of every row."""
    kinds = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]
    assert attention.KINDS[-3:] == tuple(kinds)
    rows = attention.run(kinds, quick=True, repeats=2)
    assert [(r.phase, r.format) for r in rows] == [
        (phase, kind) for phase in ("decode", "prefill") for kind in kinds
    ]
    assert all(r.op_us > 0 and r.speedup_vs_reference > 0 for r in rows)
    assert attention.cache_bytes_per_token(kinds[0]) == 2 * 8 * (128 + 4)
    for kind in kinds:
        _check_problem_matches_reference(kind)


def test_run_reads_packed_slot_caches_when_named(tiny: None, capsys: pytest.CaptureFixture) -> None:
    """The packed-slot formats run when named (not by default): slots the codec wrote, bytes of
    one slot per token and KV head, CPU_ATTN's output equal to the reference backend's."""
    named = {"turboquant_k3v4_nc", "ultraquant_4bit", "octave_k3v3_compact"}
    assert (*attention.KINDS, *attention.PACKED_FORMATS) == attention.FORMATS
    kinds = [kind for kind in attention.PACKED_FORMATS if kind in named]  # the rows' order
    assert len(kinds) == len(named)
    rows = attention.run(kinds, quick=True, repeats=2)
    assert [(r.phase, r.format) for r in rows] == [
        (phase, kind) for phase in ("decode", "prefill") for kind in kinds
    ]
    assert attention.cache_bytes_per_token("ultraquant_4bit") == 8 * (128 + 128 // 16)
    for kind in kinds:
        _check_problem_matches_reference(kind)
    assert _exit_status(["bench", "--op", "attention", "--quick", "--kinds", "nvfp4_mse"]) == USAGE
    assert "--kinds: expected some of auto, fp8" in capsys.readouterr().err
