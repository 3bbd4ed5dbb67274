"""tools/gpu_session.sh without a GPU: its --dry-run plan and its argument checks."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_session.sh"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _planned_steps(stdout: str) -> list[str]:
    return [line.split()[0] for line in stdout.splitlines() if "(at most" in line]


def test_dry_run_lists_every_step(tmp_path: Path) -> None:
    result = _run("--dry-run", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    steps = _planned_steps(result.stdout)
    assert steps[:2] == ["environment", "build"]
    assert "memcheck-tests" in steps and len(steps) == len(set(steps))


def test_only_keeps_the_named_steps_and_the_environment(tmp_path: Path) -> None:
    result = _run("--dry-run", "--only", "build,gpu-check", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _planned_steps(result.stdout) == ["environment", "build", "gpu-check"]


def test_only_rejects_an_unknown_step(tmp_path: Path) -> None:
    result = _run("--dry-run", "--only", "build,bogus", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "--only: expected step names from:" in result.stderr
    assert result.stderr.rstrip().endswith("got bogus")


def test_budget_must_be_at_least_a_minute(tmp_path: Path) -> None:
    result = _run("--dry-run", "--budget", "30", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "--budget: expected seconds >= 60, got 30" in result.stderr
