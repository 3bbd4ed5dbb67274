"""The block pool benchmark runs (``--quick`` and smaller), checks its own work (every lookup
hits, equal hashes across implementations), and says why when upstream cannot be loaded. No
timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.benchmarks.block_pool import PHASES, TOTAL, main, run

REPO_ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = os.environ.get("VLLM_UPSTREAM_SDIST", "/tmp/up/vllm-0.22.0")
TINY = ["--num-blocks", "600", "--requests", "8", "--blocks-per-request", "16", "--rounds", "2"]


def test_quick_script_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    script = REPO_ROOT / "benchmarks/core/benchmark_block_pool.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--rounds", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "allocate+free+lookup" in done.stdout
    data = json.loads(out.read_text())
    assert data["sizes"]["num_blocks"] == 8192 and data["upstream"] is None
    assert [r["phase"] for r in data["rows"]] == [*PHASES, TOTAL]
    assert all(r["us_per_block_min"] > 0 and r["repeats"] == 1 for r in data["rows"])


def test_unloadable_upstream_is_reported_and_ours_still_runs(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert main([*TINY, "--upstream", str(tmp_path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "expected upstream's block pool sources" in data["upstream_error"]
    assert {r["impl"] for r in data["rows"]} == {"ours"}
    assert "upstream: not run" in capsys.readouterr().out


@pytest.mark.skipif(
    not (Path(UPSTREAM) / "vllm/v1/core/block_pool.py").is_file(),
    reason=f"no unpacked upstream sdist at {UPSTREAM} (set VLLM_UPSTREAM_SDIST)",
)
def test_beside_upstream() -> None:
    rows, info = run(600, 8, 16, 2, upstream=UPSTREAM, log=lambda s: None)
    assert info["upstream_error"] is None and "vllm.logger" in info["stand_ins"]
    ours = {r.phase: r for r in rows if r.impl == "ours"}
    theirs = {r.phase: r for r in rows if r.impl == "upstream"}
    assert set(ours) == set(theirs) == {*PHASES, TOTAL}
    assert ours[TOTAL].x_upstream == pytest.approx(
        theirs[TOTAL].us_per_block_min / ours[TOTAL].us_per_block_min
    )


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks: expected more than requests x"):
        run(100, 10, 10, 1)
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
