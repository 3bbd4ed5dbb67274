"""Argument checks shared by the ``vllm-kv`` subcommands.

Every bad value is reported before any work starts as one line naming the argument,
``vllm-kv <cmd>: error: <arg>: expected X, got Y``, exit status 2 (docs/design.md §10). The
argparse ``type=`` callables here raise ``argparse.ArgumentTypeError`` (argparse prefixes the
option name); checks that need more than one value, or a loaded model, raise :class:`UsageError`,
which :func:`vllm.cli.main.main` prints the same way.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

EXIT_USAGE = 2
"""Exit status for a bad argument (or a missing optional package), reported before any work."""

STDOUT = "-"
"""``--json`` without a value (or ``--json -``): JSON on stdout instead of the table."""

MAX_SEED = 2**63 - 1
"""Largest ``--seed``: the data generators seed ``torch.Generator`` with ``seed + 2`` at most,
which must stay below 2**64."""

T = TypeVar("T")

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_READ_ONLY_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


class UsageError(Exception):
    """A bad command-line value, found before any work: ``str()`` is ``<arg>: <message>``."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


def int_in_range(lower: int, upper: int | None, expected: str) -> Callable[[str], int]:
    """argparse type: an integer from ``lower`` to ``upper`` (None: no upper bound); ``expected``
    describes them in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also a number of over 4300 digits
            value = lower - 1
        if value < lower or (upper is not None and value > upper):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def parsed_by(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """argparse type from a library parser whose ``ValueError`` reads ``<name>: ...``: the
    error without that prefix (argparse names the option instead)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name}: ")) from None

    return convert


def bounded_int(upper: int | None = None, what: str = "a positive integer") -> Callable[[str], int]:
    """argparse type: an integer from 1 to ``upper`` (None: no upper bound)."""
    return int_in_range(1, upper, what if upper is None else f"{what} up to {upper:,}")


seed = int_in_range(0, MAX_SEED, "an integer from 0 to 2**63-1")
"""argparse type of a seed."""


def device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N`` of a GPU torch sees; returned as given."""
    match = _DEVICE_RE.match(text)
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    if match.group(1) == "cuda":
        from vllm.utils import check_device  # imports torch: only a CUDA device needs it

        parsed_by(functools.partial(check_device, "device"), "device")(text)
    return text


def output_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as an output file (``expected ..., got ...``), or None.

    Opened for appending (an existing file is not truncated; a new one is created and removed
    again), so that a path that cannot be written fails now rather than after the work."""
    if not path:
        return "expected a file path, got ''"
    target = Path(path)
    if target.is_dir():
        return f"expected a file path, got the directory {path!r}"
    folder = target.parent
    if not folder.is_dir():
        return f"expected a path in an existing directory, got {path!r} ({folder} does not exist)"
    existed = os.path.lexists(target)
    # O_NONBLOCK: a FIFO nobody reads fails at once instead of blocking the command.
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | (0 if existed else os.O_CREAT)
    try:
        fd = os.open(target, flags, 0o666)
    except OSError as exc:
        if existed:
            return f"expected a writable file, got {path!r} ({exc.strerror})"
        why = "is not writable" if exc.errno in _READ_ONLY_ERRNOS else f"refuses it: {exc.strerror}"
        return f"expected a path in a writable directory, got {path!r} ({folder} {why})"
    try:
        why = _refused_write(fd)
    finally:
        os.close(fd)
        if not existed:
            target.unlink()
    return None if why is None else f"expected a writable file, got {path!r} ({why})"


def _refused_write(fd: int) -> str | None:
    """Why a write to the open ``fd`` is bound to fail, where that is knowable without writing a
    byte: a character device that refuses an empty write (``/dev/full``; terminals and
    ``/dev/null`` take it without output), or a new or empty file on a filesystem with no free
    block even for root. Pipes, and files holding blocks (truncating frees them), are left to
    the write."""
    info = os.fstat(fd)
    if stat.S_ISCHR(info.st_mode):
        try:
            os.write(fd, b"")
        except BlockingIOError:  # a busy terminal: the real write waits
            return None
        except OSError as exc:
            return exc.strerror
    elif stat.S_ISREG(info.st_mode) and info.st_blocks == 0:
        space = os.fstatvfs(fd)
        if space.f_blocks and not space.f_bfree:
            return os.strerror(errno.ENOSPC)
    return None


def json_output(text: str) -> str:
    """argparse type of ``--json [PATH]``: ``-`` (stdout) or a writable file path."""
    if text == STDOUT:
        return text
    problem = output_path_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def file_output(text: str) -> str:
    """argparse type of an output that only goes to a file (``--plot PNG``)."""
    if text == STDOUT:
        raise argparse.ArgumentTypeError("expected a file path, got '-' (stdout)")
    return json_output(text)


def add_json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json [PATH]``, the same in every subcommand: bare (or ``-``), ``what`` as JSON on
    stdout instead of the table; with a PATH, also written to PATH."""
    parser.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        type=json_output,
        metavar="PATH",
        help=f"{what} as JSON: with no PATH (or -) on stdout instead of the table; with a PATH "
        "written there, the table still printed",
    )


def distinct_outputs(outputs: Iterable[tuple[str, str | None]]) -> None:
    """Raise :class:`UsageError` when two output flags name the same file."""
    seen: dict[str, str] = {}
    for flag, path in outputs:
        if path is None or path == STDOUT:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(
                flag, f"expected a file other than {seen[key]}'s, got the same path {path!r}"
            )
        seen[key] = flag
