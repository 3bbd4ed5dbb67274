"""``vllm-kv``: the KV-cache command line.

Subcommands live in their own modules under :mod:`vllm.cli`; each defines
``register(subparsers) -> argparse.ArgumentParser`` that adds its parser and sets the handler
with ``parser.set_defaults(func=handler)``, where ``handler(args) -> int`` returns the exit
status. Modules are discovered at start-up, so adding a subcommand means adding a module, e.g.
``vllm/cli/check.py``; nothing here needs to change.

:func:`main` turns the CLI's known failures into one line on stderr, never a traceback: a bad
argument (argparse, or :class:`~vllm.cli.args.UsageError` from a handler's checks before its work)
exits 2; an output that cannot be written after the work exits 1 (a closed stdout pipe, as in
``vllm-kv plan | head -1``, exits 141 silently, as if killed by SIGPIPE); Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
from collections.abc import Sequence
from typing import IO, NoReturn

import vllm
import vllm.cli
from vllm.cli.args import EXIT_USAGE, UsageError
from vllm.cli.output import OutputError, discard_stdout, emit, flush_stdout

PROG = "vllm-kv"
_NOT_SUBCOMMANDS = frozenset({"main", "__main__"})
_INVALID_CHOICE = re.compile(r"^(\S+): invalid choice: (.*) \(choose from (.*)\)$")

EXIT_OUTPUT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 141


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports bad arguments as one line, ``vllm-kv plan: error: --memory: expected ...``,
    exit status 2 (the subcommands' parsers inherit this class; other command-line scripts of
    the repository use it for the same rule)."""

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        # argparse's "invalid choice: 'x' (choose from ...)" in the CLI's "expected ..., got ...".
        message = _INVALID_CHOICE.sub(r"\1: expected one of \3, got \2", message)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        # argparse drops write errors (--help, --version): stdout fails as any output does, and
        # print_help passes None when stdout is closed. stderr keeps argparse's way.
        if message and file is sys.stdout:
            emit(message)
        else:
            super()._print_message(message, file)


def subcommand_modules() -> list[str]:
    """Names of the modules under :mod:`vllm.cli` that define ``register``, sorted."""
    found = []
    for info in pkgutil.iter_modules(vllm.cli.__path__):
        if info.name in _NOT_SUBCOMMANDS or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"vllm.cli.{info.name}")
        if callable(getattr(module, "register", None)):
            found.append(module.__name__)
    return sorted(found)


def build_parser() -> argparse.ArgumentParser:
    """The ``vllm-kv`` parser with every discovered subcommand registered."""
    parser = OneLineErrorParser(
        prog=PROG, description="KV-cache tools: page sizes, memory plans and checks."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {vllm.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in subcommand_modules():
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vllm-kv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    prog = PROG
    try:
        parser = build_parser()
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return EXIT_USAGE
        prog = f"{PROG} {args.command}"
        status = int(func(args))
        flush_stdout()
        return status
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OutputError as exc:
        if exc.on_stdout:
            discard_stdout()
        if exc.closed_pipe:
            return EXIT_CLOSED_PIPE
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_OUTPUT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
