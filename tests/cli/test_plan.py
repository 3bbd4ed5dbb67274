"""``vllm-kv plan``: in-process through ``main(argv)`` and once as ``python -m vllm.cli``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.cli.main import build_parser, main, subcommand_modules
from vllm.cli.plan import parse_memory_size
from vllm.model_presets import DEFAULT_PRESET, available_presets, load_preset

REPO = Path(__file__).resolve().parents[2]
PRESETS = available_presets()
COLUMNS = (
    "bfloat16",
    "fp8",
    "nvfp4",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
)
"""The default columns: bf16 and one per quantization mode of the registry."""
GiB = 2**30


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_is_a_discovered_subcommand():
    assert "vllm.cli.plan" in subcommand_modules()
    parser = build_parser()
    assert parser.parse_args(["plan"]).command == "plan"


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "plan" in capsys.readouterr().out


def test_default_model_tables(capsys):
    code, out, _ = _run(capsys)
    assert code == 0
    assert DEFAULT_PRESET in out
    assert "full_attention" in out
    # bf16 / fp8 / nvfp4 pages of 16 tokens x 8 heads x 128 (docs/design.md §4) and bytes per token.
    for text in ("65,536", "32,768", "18,432", "131,072", "65,536", "36,864", "0.281x"):
        assert text in out
    assert "--memory" in out


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_plans_text_and_json(name, capsys):
    code, out, err = _run(capsys, "--model", name, "--memory", "80GiB")
    assert code == 0, err
    assert name in out and "max concurrency" in out and "num_blocks" in out
    code, out, err = _run(capsys, "--model", name, "--memory", "80GiB", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["model"] == name
    assert report["kv_cache_dtypes"] == list(COLUMNS)
    assert set(report["plan"]["per_dtype"]) == set(COLUMNS)
    for plan in report["plan"]["per_dtype"].values():
        assert plan["fits"]
        assert sum(t["size_bytes"] for t in plan["kv_cache_tensors"]) <= 80 * GiB
        assert plan["memory_used_bytes"] <= plan["available_memory_bytes"] == 80 * GiB
    derived = load_preset(name)["derived"]
    bf16 = report["kv_bytes"]["bfloat16"]
    for key in ("kv_bytes_per_token_bf16", "kv_bytes_per_token_if_all_layers_full_bf16"):
        if key in derived:
            assert bf16["kv_bytes_per_token"] == derived[key]
    if "growing_kv_bytes_per_token_bf16" in derived:
        assert bf16["growing_kv_bytes_per_token"] == derived["growing_kv_bytes_per_token_bf16"]


def test_per_token_head_columns_llama_8b(capsys):
    """The per-token-head formats get their own columns (from the registry): pages of
    16 tokens x 8 heads x 2 sides x (128 + 4) bytes, 1.94x the bf16 concurrency."""
    code, out, _ = _run(capsys, "--memory", "80GiB", "--max-model-len", "32768", "--json")
    assert code == 0
    report = json.loads(out)
    for dtype in ("int8_per_token_head", "fp8_per_token_head"):
        (row,) = report["layer_types"]
        assert row["page_size_bytes"][dtype] == 16 * 8 * 2 * 132 == 33792
        plan = report["plan"]["per_dtype"][dtype]
        assert plan["num_blocks"] == 80 * GiB // (32 * 33792)
        assert report["kv_bytes"][dtype]["kv_bytes_per_token"] == 32 * 8 * 2 * 132
    _, text, _ = _run(capsys, "--memory", "80GiB", "--max-model-len", "32768")
    assert "int8_per_token_head page  fp8_per_token_head page" in text
    assert "1.94x" in text


def test_gpt_oss_at_80gib(capsys):
    code, out, _ = _run(capsys, "--model", "gpt-oss-120b", "--memory", "80GiB", "--json")
    assert code == 0
    report = json.loads(out)
    plans = report["plan"]["per_dtype"]
    assert plans["bfloat16"]["num_blocks"] == 80 * GiB // (18 * 32768)
    assert plans["nvfp4"]["num_blocks"] == 80 * GiB // (18 * 9216)
    assert [g["num_layers"] for g in plans["fp8"]["groups"]] == [18, 18]
    assert report["kv_bytes"]["bfloat16"]["kv_bytes_per_token"] == 73728
    assert report["kv_bytes"]["nvfp4"]["ratio_to_bfloat16"] == pytest.approx(9 / 32)
    assert report["plan"]["max_model_len"] == 131072
    _, text, _ = _run(capsys, "--model", "gpt-oss-120b", "--memory", "80GiB")
    assert "3.56x" in text  # concurrency of nvfp4 vs bf16


def test_single_dtype_and_flags(capsys):
    code, out, _ = _run(
        capsys,
        "--model",
        "llama-3.1-70b-instruct",
        "--memory",
        "40GB",
        "--tp",
        "4",
        "--kv-cache-dtype",
        "fp8",
        "--max-model-len",
        "32768",
        "--block-size",
        "32",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert report["kv_cache_dtypes"] == ["fp8"] and report["tensor_parallel_size"] == 4
    (plan,) = report["plan"]["per_dtype"].values()
    page = 32 * 2 * 2 * 128  # block 32, 2 KV heads per rank, K+V, fp8
    assert plan["groups"][0]["page_size_bytes"] == [page]
    assert plan["num_blocks"] == 40 * 10**9 // (80 * page)
    assert plan["blocks_per_request"] == 1024


def test_skip_layers_flag(capsys):
    code, out, _ = _run(
        capsys,
        "--model",
        "gpt-oss-20b",
        "--kv-cache-dtype",
        "nvfp4",
        "--skip-layers",
        "sliding_window",
        "--json",
    )
    assert code == 0
    rows = json.loads(out)["layer_types"]
    formats = {row["kind"]: row["format"]["nvfp4"] for row in rows}
    assert formats == {"sliding_window": "bf16", "full_attention": "nvfp4"}


def test_mla_fallback_is_reported(capsys):
    code, out, _ = _run(capsys, "--model", "deepseek-v3")
    assert code == 0
    assert "18,432 (bf16)" in out and "nvfp4 is not an MLA cache format" in out
    code, out, _ = _run(capsys, "--model", "deepseek-v4-flash")
    assert "(fp8_ds_mla)" in out and "not a DeepSeek-V4 cache format" in out


def test_not_enough_memory(capsys):
    code, out, _ = _run(capsys, "--model", "llama-3.1-70b-instruct", "--memory", "20GiB")
    assert code == 0  # fp8 and nvfp4 fit
    assert "NO: max_model_len 65,536 fits" in out
    assert "needs 40.00 GiB (42,949,672,960 bytes)" in out
    code, out, _ = _run(capsys, "--model", "llama-3.1-70b-instruct", "--memory", "5GiB", "--json")
    assert code == 1
    plans = json.loads(out)["plan"]["per_dtype"]
    assert not plans["bfloat16"]["fits"]
    assert plans["bfloat16"]["bytes_per_request"] == 131072 * 327680


def test_unknown_preset_lists_available(capsys):
    code, _, err = _run(capsys, "--model", "no-such-model")
    assert code == 2
    assert "available presets" in err and "gpt-oss-120b" in err


def test_bad_flags(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--memory", "80G"])
    assert "GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--kv-cache-dtype", "int8"])
    capsys.readouterr()
    code, _, err = _run(capsys, "--model", "deepseek-v4-flash", "--block-size", "16")
    assert code == 2 and err.startswith("vllm-kv plan: error: --block-size: ")


def test_config_json_path(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_preset("qwen3-32b")["config"]))
    code, out, _ = _run(capsys, "--model", str(path), "--memory", "80GiB", "--json")
    assert code == 0
    assert json.loads(out)["kv_bytes"]["bfloat16"]["kv_bytes_per_token"] == 262144


def _write_config(folder: Path, name: str, preset: str, **changes: object) -> str:
    config = dict(load_preset(preset)["config"])
    config.update(changes)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_integers_the_planner_never_reads_are_not_checked(tmp_path, capsys):
    """Quantization and vision sub-configs, token-id sentinels: huge or negative, still planned."""
    path = _write_config(
        tmp_path,
        "extras",
        "llama-3.1-8b-instruct",
        quantization_config={"x": 2**70, "sizes": [2**64, -1]},
        vision_config={"max": 9223372036854775807, "num_hidden_layers": 10**12},
        pad_token_id=-1,
        deep={"a": [[[[{"b": 2**80}]]]]},
    )
    code, out, err = _run(capsys, "--model", path, "--memory", "80GiB", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["num_hidden_layers"] == 32


@pytest.mark.parametrize("value", [-1, 0, 2**70])
def test_a_context_length_that_is_no_size_is_ignored(value, tmp_path, capsys):
    """max_position_embeddings is only the default --max-model-len: noted, then asked for."""
    path = _write_config(tmp_path, "ctx", "qwen3-32b", max_position_embeddings=value)
    code, out, _ = _run(capsys, "--model", path, "--memory", "80GiB", "--max-model-len", "4096")
    assert code == 0
    assert "'max_position_embeddings' must be a positive int up to 2**53" in out
    code, _, err = _run(capsys, "--model", path, "--memory", "80GiB")
    assert code == 2
    assert (
        err == "vllm-kv plan: error: --max-model-len: the config has no max_position_embeddings\n"
    )


PRESET_FILES = sorted((REPO / "vllm" / "model_presets").glob("*.json"))


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_every_preset_file_plans(path, capsys):
    code, out, err = _run(capsys, "--model", str(path), "--memory", "80GiB", "--tp", "8")
    assert code == 0, err
    assert "num_blocks" in out


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80GiB", 80 * 2**30),
        ("80 gib", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1234", 1234),
        ("1234B", 1234),
        ("2TiB", 2 * 2**40),
        ("10KB", 10_000),
    ],
)
def test_parse_memory_size(text, value):
    assert parse_memory_size(text) == value


@pytest.mark.parametrize("text", ["80G", "", "GiB", "-1GiB", "1e9"])
def test_parse_memory_size_rejects(text):
    with pytest.raises(ValueError, match="memory: cannot read"):
        parse_memory_size(text)


def test_python_dash_m_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.cli",
            "plan",
            "--model",
            "gpt-oss-120b",
            "--memory",
            "80GiB",
            "--json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["plan"]["per_dtype"]["bfloat16"]["num_blocks"] == 80 * GiB // (18 * 32768)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory", "-5GiB"], "--memory: expected a positive size such as 80GiB, got '-5GiB'"),
        (["--memory=-5GiB"], "--memory: expected a positive size such as 80GiB, got '-5GiB'"),
        (["--memory", "-1", "--json"], "--memory: expected a positive size such as 80GiB, got"),
        (["--memory", "5XB"], "--memory: cannot read '5XB'; expected bytes or a number"),
        (["--tp", "-2"], "--tp: expected a positive integer up to 65,536, got '-2'"),
    ],
)
def test_bad_values_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"vllm-kv plan: error: {message}")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_json_path_writes_the_file_and_prints_the_tables(tmp_path, capsys):
    path = tmp_path / "plan.json"
    code, out, err = _run(
        capsys, "--model", "gpt-oss-120b", "--memory", "80GiB", "--json", str(path)
    )
    assert code == 0 and "max concurrency" in out
    assert json.loads(path.read_text())["model"] == "gpt-oss-120b"
    assert err == f"wrote {path}\n"
