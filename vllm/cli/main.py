"""``vllm-kv``: the KV-cache command line.

Subcommands live in their own modules under :mod:`vllm.cli`; each defines
``register(subparsers) -> argparse.ArgumentParser`` that adds its parser and sets the handler
with ``parser.set_defaults(func=handler)``, where ``handler(args) -> int`` returns the exit
status. Modules are discovered at start-up, so adding a subcommand means adding a module, e.g.
``vllm/cli/check.py``; nothing here needs to change.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import NoReturn

import vllm
import vllm.cli

PROG = "vllm-kv"
_NOT_SUBCOMMANDS = frozenset({"main", "__main__"})


class _OneLineErrorParser(argparse.ArgumentParser):
    """Reports bad arguments as one line, ``vllm-kv plan: error: --memory: expected ...``,
    exit status 2 (the subcommands' parsers inherit this class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.removeprefix('argument ')}\n")


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
    parser = _OneLineErrorParser(
        prog=PROG, description="KV-cache tools: page sizes, memory plans and checks."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {vllm.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in subcommand_modules():
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vllm-kv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args))


if __name__ == "__main__":
    raise SystemExit(main())
