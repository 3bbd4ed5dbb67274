"""``vllm-kv bench --op formats``: write and decode rows of every format with a codec, v0.33's
new formats included, each naming the implementation it timed; tiny real runs on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from vllm.benchmarks import formats as format_bench
from vllm.cli.main import main

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

NEW = (
    "nvfp4_4over6",
    "int4_per_token_head",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
    "octave_k3v4",
    "octave_k3v3",
    "octave_k3v3_compact",
)


def test_every_new_format_has_rows() -> None:
    assert set(NEW) <= set(format_bench.FORMAT_KINDS)
    assert "nvfp4_ds_mla" not in format_bench.FORMAT_KINDS  # an MLA record, no K/V rows


def test_tiny_real_run_names_the_implementation() -> None:
    kinds = ["int4_per_token_head", "octave_k3v3_compact"]
    rows = format_bench.run("cpu", kinds, [4], quick=True, repeats=1)
    assert [(r.kind, r.stage) for r in rows] == [
        ("int4_per_token_head", "write"),
        ("int4_per_token_head", "decode"),
        ("octave_k3v3_compact", "write"),
        ("octave_k3v3_compact", "decode"),
    ]
    # The compiled ops write INT4 and Octave (_C::octave_cache_store); decodes are the codecs'.
    impls = ["compiled op", "reference codec", "compiled op", "reference codec"]
    assert [r.impl for r in rows] == impls
    for r in rows:
        assert r.op_us > 0 and r.op_gbps > 0 and r.pct_roofline > 0 and r.roofline_gbps > 0
    # Octave compact write: bf16 K and V (2 * 4 * 8 * 128 * 2), int64 slots, 4 * 8 slots of 100.
    assert rows[2].bytes_moved == 2 * 4 * 8 * 128 * 2 + 4 * 8 + 4 * 8 * 100
    table = format_bench.format_table(rows)
    assert "reference codec" in table and "not a kernel's throughput" in table
    doc = format_bench.to_json(rows)
    assert doc["rows"][1]["stage"] == "decode" and doc["rows"][1]["impl"] == "reference codec"


def _fake_rows(kinds: list[str]) -> list[format_bench.Row]:
    return [
        format_bench.Row(
            kind=kind,
            stage=stage,
            impl="reference codec",
            num_tokens=16,
            num_heads=8,
            head_size=128,
            device="cpu",
            op_us=100.0,
            bytes_moved=10_000,
            op_gbps=0.1,
            roofline_gbps=5.0,
            pct_roofline=2.0,
            repeats=1,
            op_us_samples=[100.0],
            roofline_gbps_samples=[5.0],
            load_avg=[0.1, 0.1],
        )
        for kind in kinds
        for stage in ("write", "decode")
    ]


def test_cli_defaults_and_json(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    calls: list[list[str]] = []

    def run(device, kinds, tokens, quick, progress, warm=False):
        calls.append(list(kinds))
        return _fake_rows(list(kinds))

    monkeypatch.setattr(format_bench, "run", run)
    assert main(["bench", "--op", "formats", "--no-progress", "--device", "cpu"]) == 0
    assert calls[0] == list(format_bench.FORMAT_KINDS)
    out = capsys.readouterr().out
    assert "octave_k3v4" in out and "decode" in out and "% roofline" in out
    argv = ["bench", "--op", "formats", "--no-progress", "--kinds", "ultraquant_4bit", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["kind"], r["stage"]) for r in rows] == [
        ("ultraquant_4bit", "write"),
        ("ultraquant_4bit", "decode"),
    ]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--op", "formats", "--kinds", "auto"], "--kinds: expected some of fp8_e4m3"),
        (["--kinds", "octave_k3v4"], "--kinds: expected some of auto"),
        (["--op", "formats", "--plot", "x.png"], "--plot"),
    ],
)
def test_bad_combinations_are_one_line(capsys, tmp_path, argv: list[str], expected: str) -> None:
    argv = [a if a != "x.png" else str(tmp_path / a) for a in argv]
    assert main(["bench", "--no-progress", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("vllm-kv bench: error: ") and captured.err.count("\n") == 1
    assert expected in captured.err and "Traceback" not in captured.err


def test_packed_stores_are_timed_through_the_extension() -> None:
    """TurboQuant's and UltraQuant's write rows time the compiled stores; what they write
    decodes to values (their bytes equal the codecs': tests/kv_quant)."""
    kinds = ["turboquant_4bit_nc", "ultraquant_4bit"]
    rows = format_bench.run("cpu", kinds, [4], quick=True, repeats=1)
    assert [(r.kind, r.stage, r.impl) for r in rows] == [
        ("turboquant_4bit_nc", "write", "compiled op"),
        ("turboquant_4bit_nc", "decode", "reference codec"),
        ("ultraquant_4bit", "write", "compiled op"),
        ("ultraquant_4bit", "decode", "reference codec"),
    ]
    for kind in kinds:
        problem = format_bench._problem(kind, 4, torch.device("cpu"))
        problem.write()
        key, value = problem.decode()
        assert key.shape == value.shape == (4, format_bench.NUM_HEADS, format_bench.HEAD_SIZE)
        assert bool(value.abs().sum() > 0)
