"""Output of the ``vllm-kv`` subcommands: stdout and output files.

A write that fails after the work (a full disk, a closed pipe) raises :class:`OutputError`, which
:func:`vllm.cli.main.main` reports in one line (a closed stdout pipe quietly), instead of a
traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from vllm.cli.args import STDOUT

STDOUT_NAME = "stdout"


class OutputError(Exception):
    """``target`` (``stdout`` or an output flag) could not be written."""

    def __init__(self, target: str, path: str | None, error: OSError) -> None:
        where = f" {path!r}" if path is not None else ""
        super().__init__(f"{target}: cannot write{where}: {error.strerror or error}")
        self.target = target
        self.error = error

    @property
    def on_stdout(self) -> bool:
        return self.target == STDOUT_NAME

    @property
    def closed_pipe(self) -> bool:
        """stdout's reader went away (``vllm-kv plan | head -1``): not an error to report."""
        return self.on_stdout and isinstance(self.error, BrokenPipeError)


@contextlib.contextmanager
def writing(target: str, path: str | None = None) -> Iterator[None]:
    """Turn an ``OSError`` raised in the block into :class:`OutputError` for ``target``."""
    try:
        yield
    except OSError as exc:
        raise OutputError(target, path, exc) from exc


def _stdout() -> TextIO:
    # Python sets sys.stdout to None when started with file descriptor 1 closed (`>&-`).
    if sys.stdout is None:
        raise OutputError(STDOUT_NAME, None, OSError(errno.EBADF, os.strerror(errno.EBADF)))
    return sys.stdout


def emit(text: str) -> None:
    """Write ``text`` and a newline to stdout now (flushed, so a full or closed stdout fails
    here, not in the interpreter's exit)."""
    stdout = _stdout()
    with writing(STDOUT_NAME):
        stdout.write(text if text.endswith("\n") else text + "\n")
        stdout.flush()


def flush_stdout() -> None:
    """Flush stdout (what the command printed without :func:`emit`)."""
    if sys.stdout is not None:
        with writing(STDOUT_NAME):
            sys.stdout.flush()


def discard_stdout() -> None:
    """Point stdout at the null device, so that what is still buffered after a failed write
    does not fail again when the interpreter exits."""
    if sys.stdout is None:
        return
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def write_file(flag: str, path: str, text: str) -> None:
    """Write ``text`` to ``path`` (the value of ``flag``) and say so on stderr."""
    with writing(flag, path), open(path, "w", encoding="utf-8") as out:
        out.write(text)
    print(f"wrote {path}", file=sys.stderr)


def deliver(table: Callable[[], str], json_text: Callable[[], str], target: str | None) -> None:
    """What ``--json`` asks for: the table unless the JSON goes to stdout instead, and the JSON
    to ``target`` when given (each rendered only when it is written)."""
    if target != STDOUT:
        emit(table())
    if target is not None:
        deliver_json(json_text(), target)


def deliver_json(text: str, target: str) -> None:
    """JSON ``text`` to the ``--json`` target: stdout (``-``) or a file."""
    if target == STDOUT:
        emit(text)
    else:
        write_file("--json", target, text if text.endswith("\n") else text + "\n")
