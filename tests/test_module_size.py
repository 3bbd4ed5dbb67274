"""Modules do one job: no Python module of the repository (packages, tests, benchmarks, tools)
and no C++ / CUDA source or header of the extension is over 600 lines."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 600
TREES = ("vllm", "real_kv_samples", "tests", "benchmarks")
NATIVE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")


def _modules() -> list[Path]:
    return [
        *(path for tree in TREES for path in (REPO / tree).rglob("*.py")),
        *(REPO / "tools").glob("*.py"),
        *(path for path in (REPO / "csrc").rglob("*") if path.suffix in NATIVE_SUFFIXES),
    ]


def test_no_module_over_600_lines() -> None:
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
        for path in _modules()
    }
    assert len(sizes) > 150
    assert any(name.startswith("tools/") for name in sizes)
    assert any(name.startswith("csrc/cpu/") and name.endswith(".h") for name in sizes)
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
