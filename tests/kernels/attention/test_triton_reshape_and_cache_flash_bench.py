"""benchmarks/kernels/benchmark_triton_reshape_and_cache_flash.py --quick: the Triton writer's
bytes against the compiled op's for every format (PASS per format), and its timing columns.
Under Triton's interpreter here; natively on a GPU."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from vllm.kv_quant.formats import formats
from vllm.triton_utils import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "kernels"
SCRIPT = SCRIPT / "benchmark_triton_reshape_and_cache_flash.py"


@pytest.fixture(scope="module")
def bench() -> dict:
    return runpy.run_path(str(SCRIPT), run_name="bench")


def test_every_format_passes(bench: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench["main"](["--quick", "--no-timing"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    written = [f.name for f in formats() if f.cache_kind is not None and f.has_kernel]
    assert [r.split()[0] for r in rows] == written
    assert all(r.split()[3] == "PASS" for r in rows), rows


def test_timing_columns(bench: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench["main"](["--quick", "--kinds", "fp8_e5m2"]) == 0
    (row,) = capsys.readouterr().out.splitlines()[1:]
    kind, tokens, heads, status, triton_gbps, op_gbps, ratio = row.split()
    assert (kind, tokens, heads, status) == ("fp8_e5m2", "2", "1", "PASS")
    assert float(triton_gbps) >= 0 and float(op_gbps) > 0 and float(ratio) >= 0


def test_rejects_unknown_kinds(bench: dict) -> None:
    with pytest.raises(SystemExit):
        bench["main"](["--kinds", "fp8_ds_mla"])
