"""Whether Triton is importable, and stand-ins for ``triton`` / ``triton.language`` when it is not,
under upstream vLLM's import path (``vllm.triton_utils.importing``).

Modules holding Triton kernels import ``triton`` and ``tl`` from :mod:`vllm.triton_utils`, so that
importing the library never needs Triton: without it, ``@triton.jit`` leaves the function as plain
Python (never launched without Triton), ``tl.constexpr(v)`` module constants stay ``v`` and
other ``tl`` attributes (annotations such as ``tl.int64``) resolve to ``None``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

from vllm.utils.math_utils import cdiv

__all__ = ["HAS_TRITON", "TritonLanguagePlaceholder", "TritonPlaceholder"]

# Unlike upstream, no active-driver check: without a GPU the kernels still run under Triton's
# interpreter (TRITON_INTERPRET=1), and the AOT compile check needs no driver at all.
HAS_TRITON: bool = find_spec("triton") is not None


class TritonPlaceholder(types.ModuleType):
    """Stand-in for the ``triton`` module: its decorators return the function unchanged."""

    def __init__(self) -> None:
        super().__init__("triton")
        self.__version__ = "0.0.0"
        self.jit = self._dummy_decorator()
        self.autotune = self._dummy_decorator()
        self.heuristics = self._dummy_decorator()
        self.Config = self._dummy_decorator()
        self.cdiv = cdiv
        self.language = TritonLanguagePlaceholder()

    @staticmethod
    def _dummy_decorator() -> Callable[..., Any]:
        def decorator(*args: Any, **kwargs: Any) -> Any:
            # Used bare (@triton.jit) or with arguments (@triton.jit(...)).
            if args and callable(args[0]):
                return args[0]
            return lambda f: f

        return decorator


def _constexpr(value: Any = None) -> Any:
    return value


class TritonLanguagePlaceholder(types.ModuleType):
    """Stand-in for ``triton.language``: every attribute a kernel signature names is ``None``."""

    def __init__(self) -> None:
        super().__init__("triton.language")
        # Module constants of kernel files are spelled tl.constexpr(value).
        self.constexpr = _constexpr

    def __getattr__(self, name: str) -> None:
        # Annotations (tl.constexpr, tl.int64, ...) are evaluated when a kernel is defined.
        if name.startswith("__"):
            raise AttributeError(name)
        return None
