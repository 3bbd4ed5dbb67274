"""The Triton attention decode benchmark (benchmarks/kernels/benchmark_triton_attention.py) on
its quick shape: rows, ratios, Markdown, JSON and the argument errors (under Triton's
interpreter without a GPU)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

from vllm.benchmarks import attention, noise

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kernels" / "benchmark_triton_attention.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_triton_attention", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def test_quick_rows(bench: ModuleType) -> None:
    rows = bench.run(["nvfp4", "auto"], quick=True, warm=True, repeats=2)
    assert [(r.format, r.batch, r.context) for r in rows] == [("auto", 1, 64), ("nvfp4", 1, 64)]
    for r in rows:
        assert r.op_us > 0 and r.roofline_gbps > 0 and r.num_splits >= 1
        assert r.repeats == 2 == len(r.op_us_samples)
        assert r.op_us == statistics.median(r.op_us_samples)
        assert r.bytes_moved == attention.bytes_moved(r.format, 1, 1, 64)
        assert r.op_gbps == pytest.approx(r.bytes_moved / r.op_us / 1e3)
        assert set(r.flags) <= set(noise.FLAGS)
        assert r.flashinfer_us is None  # flashinfer only on a GPU
    assert rows[0].time_vs_bf16 == 1.0
    assert rows[1].time_vs_bf16 == pytest.approx(rows[1].op_us / rows[0].op_us)
    table = bench.to_markdown(rows)
    assert table.count("\n| auto |") == 1 and "% of copy roofline" in table
    document = bench.to_json(rows)
    assert document["backend"] == "TRITON_ATTN" and len(document["rows"]) == 2
    json.dumps(document)
    with pytest.raises(ValueError, match=r"formats: unknown \['int4'\]"):
        bench.run(["int4"])


def test_cli_writes_json_and_markdown(bench: ModuleType, tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    argv = ["--quick", "--warm", "--repeats", "1", "--formats", "fp8"]
    assert bench.main([*argv, "--json", str(out_json), "--markdown", str(out_md)]) == 0
    assert json.loads(out_json.read_text())["rows"][0]["format"] == "fp8"
    assert "| fp8 | 1 | 64 |" in out_md.read_text()
    assert bench.main(["--quick", "--formats", "int4"]) == 2
