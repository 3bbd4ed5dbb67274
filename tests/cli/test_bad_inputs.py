"""Bad command lines, table-driven: exit status 2, exactly one line on stderr naming the argument
(``vllm-kv <cmd>: error: <arg>: ...``), nothing on stdout, no traceback, and nothing run.

Most cases call ``main()`` in-process (fast); a few run ``python -m vllm.cli`` to show that no
traceback reaches a user, and the cases that need a real process (a full or closed stdout,
Ctrl-C) run one.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import torch

from vllm.accuracy.cache_io import extension_status
from vllm.benchmarks import attention
from vllm.benchmarks import reshape_and_cache_flash as core
from vllm.cli import args as cli_args
from vllm.cli import bench, check
from vllm.cli.args import EXIT_USAGE, STDOUT, UsageError
from vllm.cli.main import (
    EXIT_CLOSED_PIPE,
    EXIT_INTERRUPTED,
    EXIT_OUTPUT_FAILED,
    build_parser,
    main,
)
from vllm.model_presets import load_preset

REPO = Path(__file__).resolve().parents[2]
LLAMA = "llama-3.1-8b-instruct"  # 32 attention heads, 8 KV heads


def _config_with(**changes: object) -> str:
    config = dict(load_preset(LLAMA)["config"])
    config.update(changes)
    return json.dumps(config)


# Files named {NAME} in the cases' argv, written into a temporary directory ({tmp}).
INPUT_FILES: dict[str, str | bytes] = {
    "layers": _config_with(num_hidden_layers=10**12),
    "huge_int": _config_with(head_dim=10**30),
    "kv_heads": _config_with(num_key_value_heads=2**70),
    "window": _config_with(sliding_window=2**60),
    "binary": bytes(range(256)) * 4,
    "empty": "",
    "list": "[1, 2]",
    "broken": '{"model_type": ',
    "deep": "[" * 100_000 + "]" * 100_000,
    "no_type": json.dumps({"num_hidden_layers": 2}),
}


FULL = "expected a writable file, got '/dev/full' (No space left on device)"


def case(cmd: str, argv: list[str], expected: str) -> object:
    """A bad ``vllm-kv cmd argv``; stderr must start ``vllm-kv cmd: error: {expected}``."""
    return pytest.param(cmd, argv, expected, id=f"{cmd} {' '.join(argv)}"[:80])


CASES = [
    # plan --model: files that are no config, and configs out of bounds
    case(
        "plan",
        ["--model", "{layers}"],
        "--model: {layers}: config: key 'num_hidden_layers' must be a positive int up to 10,000, "
        "got 1000000000000",
    ),
    case(
        "plan",
        ["--model", "{huge_int}"],
        "--model: {huge_int}: config: key 'head_dim' must be a positive int up to 2**53, got a "
        "31-digit number",
    ),
    case("plan", ["--model", "{kv_heads}"], "--model: {kv_heads}: config: key 'num_key_value_"),
    case("plan", ["--model", "{window}"], "--model: {window}: config: key 'sliding_window' must"),
    case("plan", ["--model", "{binary}"], "--model: expected a UTF-8 JSON config file, got"),
    case("plan", ["--model", "{tmp}"], "--model: expected a config.json file, got"),
    case("plan", ["--model", "{tmp}/missing.json"], "--model: expected a shipped preset or a"),
    case("plan", ["--model", "no-such-model"], "--model: expected a shipped preset or a"),
    case("plan", ["--model", "{empty}"], "--model: expected a JSON config file, got"),
    case("plan", ["--model", "{list}"], "--model: expected a JSON object (a config.json), got"),
    case("plan", ["--model", "{broken}"], "--model: expected a JSON config file, got"),
    case("plan", ["--model", "{deep}"], "--model: expected a JSON config file, got"),
    case("plan", ["--model", "{no_type}"], "--model: {no_type}: config: missing key 'model_type'"),
    case("plan", ["--model", "/dev/zero"], "--model: expected a config.json file, got"),
    case("plan", ["--model", ""], "--model: expected a preset name or a config.json path, got ''"),
    # plan: numbers
    case("plan", ["--tp", "1000"], "--tp: expected a divisor of the 32 attention heads"),
    case("plan", ["--tp", "3"], "--tp: expected a divisor of the 32 attention heads"),
    case("plan", ["--tp", "0"], "--tp: expected a positive integer"),
    case("plan", ["--tp", "two"], "--tp: expected a positive integer"),
    case("plan", ["--memory", "0"], "--memory: expected a positive size"),
    case("plan", ["--memory", "-5GiB"], "--memory: expected a positive size"),
    case("plan", ["--memory", "80G"], "--memory: cannot read '80G'"),
    case("plan", ["--memory", "9" * 40 + "TiB"], "--memory: expected a positive size"),
    case("plan", ["--memory", ""], "--memory: cannot read ''"),
    case("plan", ["--max-model-len", "0"], "--max-model-len: expected a positive integer"),
    case("plan", ["--max-model-len", "1e5"], "--max-model-len: expected a positive integer"),
    case("plan", ["--max-model-len", str(2**41)], "--max-model-len: expected a positive integer"),
    case("plan", ["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens: expected a"),
    case("plan", ["--block-size", str(2**21)], "--block-size: expected a positive integer"),
    case("plan", ["--model", "deepseek-v4-flash", "--block-size", "16"], "--block-size: "),
    case("plan", ["--kv-cache-dtype", "int8"], "--kv-cache-dtype: unknown KV-cache dtype 'int8'"),
    case("plan", ["--skip-layers", "nonsense"], "--skip-layers: 'nonsense' is neither"),
    # plan: outputs
    case("plan", ["--json", ""], "--json: expected a file path, got ''"),
    case("plan", ["--json", "/proc/x.json"], "--json: expected a path in a writable directory"),
    case("plan", ["--json", "{tmp}"], "--json: expected a file path, got the directory"),
    case("plan", ["--json", "{tmp}/missing/x.json"], "--json: expected a path in an existing"),
    case("plan", ["--json", "/dev/full"], f"--json: {FULL}"),
    # check
    case("check", ["--device", "meta"], "--device: expected cpu or cuda[:N], got 'meta'"),
    case("check", ["--device", "tpu"], "--device: expected cpu or cuda[:N], got 'tpu'"),
    case("check", ["--device", "cuda:abc"], "--device: expected cpu or cuda[:N], got 'cuda:abc'"),
    case("check", ["--device", "cpu:0"], "--device: expected cpu or cuda[:N], got 'cpu:0'"),
    case("check", ["--seed", str(10**23)], "--seed: expected an integer from 0 to 2**63-1"),
    case("check", ["--seed", "-1"], "--seed: expected an integer from 0 to 2**63-1, got '-1'"),
    case("check", ["--formats", "int4"], "--formats: unknown KV-cache dtype 'int4'"),
    case("check", ["--writer", "nope"], "--writer: expected one of 'auto', 'op', 'reference'"),
    case("check", ["--layout", "XYZ"], "--layout: expected one of 'NHD', 'HND', got 'XYZ'"),
    case("check", ["--json", "/proc/x.json"], "--json: expected a path in a writable directory"),
    case("check", ["--json", "/dev/full"], f"--json: {FULL}"),
    # check: the model report's options without --model
    *(
        case("check", [flag, value], f"{flag}: expected --model with it (an option of the model")
        for flag, value in (
            ("--max-tokens", "64"),
            ("--new-tokens", "5"),
            ("--prompts", "2"),
            ("--attention", "REFERENCE"),
            ("--threads", "1"),
            ("--plot", "{tmp}/plot.png"),
        )
    ),
    # bench: rejected before anything runs
    case("bench", ["--device", "tpu"], "--device: expected cpu or cuda[:N], got 'tpu'"),
    case("bench", ["--device", "cuda:abc"], "--device: expected cpu or cuda[:N], got 'cuda:abc'"),
    case("bench", ["--tokens", "100000000000"], "--tokens: expected at most"),
    case("bench", ["--tokens", "16", "0"], "--tokens: expected a positive integer, got '0'"),
    case("bench", ["--tokens", "-5"], "--tokens: expected a positive integer, got '-5'"),
    case("bench", ["--threads", "1000000"], "--threads: expected a thread count"),
    case("bench", ["--threads", "0"], "--threads: expected a thread count"),
    case(
        "bench",
        ["--kinds", "int4"],
        "--kinds: expected some of auto, fp8, nvfp4, int8_per_token_head, fp8_per_token_head, "
        "int4_per_token_head with --op reshape_and_cache_flash, got int4",
    ),
    case(
        "bench",
        ["--op", "attention", "--kinds", "nvfp4+bogus"],
        "--kinds: expected some of auto, fp8, nvfp4",
    ),
    case(
        "bench",
        ["--kinds", "nvfp4+offset"],
        "--kinds: expected some of auto, fp8, nvfp4, int8_per_token_head, fp8_per_token_head, "
        "int4_per_token_head with --op reshape_and_cache_flash, got nvfp4+offset",
    ),
    case("bench", ["--op", "matmul"], "--op: expected one of"),
    case("bench", ["--op", "attention", "--tokens", "16"], "--tokens: not used by --op attention"),
    case(
        "bench",
        ["--block-size", "64"],
        "--block-size: not used by --op reshape_and_cache_flash (pages of 16 tokens), got 64",
    ),
    case("bench", ["--op", "attention", "--block-size", "0"], "--block-size: expected a page size"),
    case(
        "bench",
        ["--op", "attention", "--block-size", "5000"],
        "--block-size: expected a page size up to 4,096, got '5000'",
    ),
    case("bench", ["--json", "{tmp}/x", "--plot", "{tmp}/./x"], "--plot: "),
    case("bench", ["--json", ""], "--json: expected a file path, got ''"),
    case("bench", ["--plot", ""], "--plot: expected a file path, got ''"),
    case("bench", ["--plot", "-"], "--plot: expected a file path, got '-' (stdout)"),
    case("bench", ["--json", "/proc/x.json"], "--json: expected a path in a writable directory"),
    case("bench", ["--plot", "/proc/x.png"], "--plot: expected a path in a writable directory"),
    case("bench", ["--json", "/dev/full"], f"--json: {FULL}"),
    case("bench", ["--plot", "/dev/full"], f"--plot: {FULL}"),
    case("bench", ["--json", "--quick", "--kinds", "x"], "--kinds: expected some of"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``{NAME}`` -> path of each of :data:`INPUT_FILES`, and ``{tmp}`` -> their directory."""
    folder = tmp_path_factory.mktemp("bad_inputs")
    paths = {"tmp": str(folder)}
    for name, content in INPUT_FILES.items():
        path = folder / f"{name}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        paths[name] = str(path)
    return paths


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a case that starts a benchmark or a check instead of rejecting its arguments."""

    def ran(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the work started before the arguments were rejected")

    for module, name in ((core, "run"), (attention, "run"), (check, "run_check")):
        monkeypatch.setattr(module, name, ran)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse rejects
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line(cmd: str, code: int, out: str, err: str, expected: str) -> None:
    assert (code, out) == (EXIT_USAGE, ""), err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"vllm-kv {cmd}: error: {expected}"), err


@pytest.mark.usefixtures("nothing_runs")
@pytest.mark.parametrize(("cmd", "argv", "expected"), CASES)
def test_bad_input_is_one_line(
    cmd: str, argv: list[str], expected: str, inputs: dict[str, str], capsys: pytest.CaptureFixture
) -> None:
    argv = [a.format(**inputs) for a in argv]
    code, out, err = _main([cmd, *argv], capsys)
    _assert_one_line(cmd, code, out, err, expected.format(**inputs))


def _cli(
    *argv: str,
    stdout: int | IO[str] | None = subprocess.PIPE,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m vllm.cli argv`` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "vllm.cli", *argv],
        cwd=REPO,
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "--model", "{layers}"], "--model: {layers}: config: key 'num_hidden_layers'"),
        (["bench", "--device", "tpu"], "--device: expected cpu or cuda[:N], got 'tpu'"),
        (["check", "--seed", str(10**23)], "--seed: expected an integer from 0 to 2**63-1"),
    ],
)
def test_no_traceback_reaches_the_user(
    argv: list[str], expected: str, inputs: dict[str, str]
) -> None:
    result = _cli(*(a.format(**inputs) for a in argv))
    _assert_one_line(
        argv[0], result.returncode, result.stdout, result.stderr, expected.format(**inputs)
    )


# Fast arguments of a real ``check`` (one format, the reference codecs).
QUICK_CHECK = ["check", "--formats", "bf16", "--writer", "reference", "--reader", "codec"]


@pytest.mark.parametrize("argv", [["plan", "--json"], QUICK_CHECK], ids=["plan", "check"])
def test_full_stdout_is_one_line(argv: list[str]) -> None:
    with open("/dev/full", "w") as full:
        result = _cli(*argv, stdout=full)
    assert result.returncode == EXIT_OUTPUT_FAILED
    assert result.stderr == (
        f"vllm-kv {argv[0]}: error: stdout: cannot write: No space left on device\n"
    )


@pytest.mark.parametrize(
    ("argv", "buffered"),
    [
        (["--version"], False),
        (["--version"], True),
        (["--help"], True),
        (["check", "--help"], False),
    ],
)
def test_version_and_help_to_a_full_stdout_fail(argv: list[str], buffered: bool) -> None:
    """argparse drops the write error of what it prints itself; the CLI reports it (a buffered
    stdout would otherwise fail only at exit, with exit status 120 and no line of ours)."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        result = _cli(*argv, stdout=full, env=env)
    assert (result.returncode, result.stderr) == (
        EXIT_OUTPUT_FAILED,
        "vllm-kv: error: stdout: cannot write: No space left on device\n",
    )


def test_closed_stdout_pipe_is_quiet() -> None:
    """``vllm-kv plan --json | head -c0``: the reader is gone before the first write."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.cli", "plan", "--json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (EXIT_CLOSED_PIPE, b"")


def test_ctrl_c_is_one_line() -> None:
    """SIGINT once the progress bar shows: exit 130, the bar's line ended, then one line."""
    ok, why = extension_status()
    if not ok:
        pytest.skip(f"the benchmark needs the compiled extension: {why}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.cli", "bench", "--device", "cpu", "--threads", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # SIGINT as a terminal delivers it: a shell without job control starts background
        # commands with it ignored, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    first = proc.stderr.read(1)  # the bar (or a load warning): the benchmark has started
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=120)
    err = (first + rest).decode()
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, err)
    assert out == b"" and "Traceback" not in err
    assert err.split("\n")[-2:] == ["vllm-kv: interrupted", ""], err  # a line of its own


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark replaced by a stand-in returning no rows, and a table of them."""
    monkeypatch.setattr(core, "run", lambda *_a, **_k: [])
    monkeypatch.setattr(core, "to_json", lambda rows: {"rows": rows})
    monkeypatch.setattr("vllm.cli.bench.format_table", lambda rows: "table")


@pytest.mark.usefixtures("fake_bench")
@pytest.mark.parametrize(
    "argv",
    [["plan", "--json", "/dev/full"], ["bench", "--no-progress", "--json", "/dev/full"]],
    ids=["plan", "bench"],
)
def test_output_file_error_after_the_work(
    argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that passes the check but fails when written (a disk filled during the run, here
    /dev/full with its check skipped): exit 1, one line naming the flag."""
    monkeypatch.setattr(cli_args, "_refused_write", lambda _fd: None)
    code, out, err = _main(argv, capsys)
    assert code == EXIT_OUTPUT_FAILED
    assert out != ""  # the table was printed
    assert err == (
        f"vllm-kv {argv[0]}: error: --json: cannot write '/dev/full': No space left on device\n"
    )


def test_outputs_probe_leaves_files_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The writability check neither truncates an existing file nor leaves a new one behind."""
    existing = tmp_path / "keep.json"
    existing.write_text("old")
    code, _, _ = _main(["plan", "--json", str(existing), "--tp", "3"], capsys)
    assert code == EXIT_USAGE and existing.read_text() == "old"
    new = tmp_path / "new.json"
    code, _, _ = _main(["plan", "--json", str(new), "--tp", "3"], capsys)
    assert code == EXIT_USAGE and not new.exists()


def test_outputs_probe_a_full_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No free block, even for root: a new or empty file is refused before the work; a file
    holding blocks is not (truncating it frees them)."""
    # bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax
    full = os.statvfs_result((4096, 4096, 1000, 0, 0, 100, 50, 50, 0, 255))
    monkeypatch.setattr(os, "fstatvfs", lambda _fd: full)
    empty, holding = tmp_path / "empty.json", tmp_path / "old.json"
    empty.touch()
    holding.write_text("x" * 10_000)
    for path in (tmp_path / "new.json", empty):
        problem = cli_args.output_path_problem(str(path))
        assert problem == f"expected a writable file, got '{path}' (No space left on device)"
    assert cli_args.output_path_problem(str(holding)) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.json", "old.json"]
    assert holding.read_text() == "x" * 10_000


def test_outputs_probe_writes_nothing_to_a_terminal() -> None:
    """A terminal passes the check (its empty write shows nothing); /dev/null passes too."""
    leader, follower = pty.openpty()
    try:
        assert cli_args.json_output(os.ttyname(follower)) == os.ttyname(follower)
        assert cli_args.json_output(os.devnull) == os.devnull
        assert select.select([leader], [], [], 0.2)[0] == []
    finally:
        os.close(leader)
        os.close(follower)


@pytest.mark.parametrize(
    ("cmd", "option"), [("plan", ["--tp", "1"]), ("check", ["--real"]), ("bench", ["--quick"])]
)
def test_json_flag_means_the_same_everywhere(cmd: str, option: list[str], tmp_path: Path) -> None:
    """``--json`` alone: JSON on stdout; ``--json PATH``: a file; a following option is not
    taken as the PATH."""
    parser = build_parser()
    assert parser.parse_args([cmd]).json is None
    assert parser.parse_args([cmd, "--json"]).json == STDOUT
    assert parser.parse_args([cmd, "--json", *option]).json == STDOUT
    path = str(tmp_path / "out.json")
    assert parser.parse_args([cmd, "--json", path]).json == path
    assert not os.path.exists(path)


def test_cuda_checks_with_two_simulated_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branches of ``--device`` and of the ``--tokens`` memory check, without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (2**30, 80 * 2**30))
    assert cli_args.device("cuda") == "cuda" and cli_args.device("cuda:1") == "cuda:1"
    with pytest.raises(argparse.ArgumentTypeError, match=r"cuda:0\.\.cuda:1 .* got 'cuda:2'"):
        cli_args.device("cuda:2")
    bench.check_tokens_fit(["auto"], [1024], "cuda:1")  # 32 MiB of 1 GiB free
    with pytest.raises(UsageError, match=r"--tokens: expected at most 32,768 tokens per call"):
        bench.check_tokens_fit(["auto"], [10**6], "cuda:1")
