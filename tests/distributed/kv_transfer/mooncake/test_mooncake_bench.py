"""The Mooncake benchmark runs end to end (tiny sizes) and reports sane figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mooncake_harness import REPO_ROOT

pytestmark = pytest.mark.needs_mooncake


def test_benchmark_runs_and_reports(sandbox, tmp_path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(REPO_ROOT / "benchmarks/kv_transfer/benchmark_mooncake.py")]
    argv += ["--layers", "1", "--blocks", "2", "--reps", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        sandbox.command(argv), capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rep 1/1" in proc.stderr  # progress
    assert "| store put |" in proc.stdout and "× batch call" in proc.stdout
    rows = {r["path"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["memcpy", "store put", "batch put", "store get", "batch get", "P2P"]
    for row in rows.values():
        assert row["bytes"] == 2 * 64 * 1024 and row["pages"] == 2
        assert row["seconds"] > 0 and row["gb_per_s"] > 0
    for path, base in (("store put", "batch put"), ("store get", "batch get")):
        ratio = rows[base]["seconds"] / rows[path]["seconds"]
        assert rows[path]["vs_batch_call"] == pytest.approx(ratio)
    assert rows["memcpy"]["vs_batch_call"] is None


def test_versus_batch_call() -> None:
    from vllm.benchmarks.mooncake_transfer import BenchResult, markdown, versus_batch_call

    results = [
        BenchResult("memcpy", 1, 1, 100, 1.0),
        BenchResult("store put", 1, 1, 100, 4.0),
        BenchResult("batch put", 1, 1, 100, 3.0),
    ]
    assert versus_batch_call(results) == {"store put": 0.75}
    assert "| store put | 1 | 1 | 0 | 4000.00 | 0 | 0.00 | 0.250 | 0.75 |" in markdown(results)


def test_benchmark_rejects_bad_arguments() -> None:
    from vllm.benchmarks.mooncake_transfer import main

    assert main(["--blocks", "0"]) == 2
