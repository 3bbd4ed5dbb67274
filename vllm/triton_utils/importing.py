"""Whether Triton is installed and whether it can run kernels here, and stand-ins for ``triton``
/ ``triton.language`` when it is not installed, under upstream vLLM's import path
(``vllm.triton_utils.importing``).

Two facts, kept apart:

* :data:`TRITON_INSTALLED`: ``triton`` is installed and imports. :mod:`vllm.triton_utils`
  then hands out the real modules, so kernels are ``@triton.jit`` functions that Triton's
  compiler takes (the ahead-of-time compile of :mod:`vllm.triton_utils.aot` needs no driver).
* :data:`HAS_TRITON`: Triton can also launch kernels in this process, by upstream's rules:
  exactly one active GPU driver (Triton's ``cpu`` backend is not counted: its driver always
  says it is active), none while ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` is set
  but blank (a distributed worker before its devices are assigned), and on a Triton-CPU build
  of the library (a ``cpu`` local version) the ``cpu`` backend. Beyond upstream, Triton's
  interpreter (``TRITON_INTERPRET`` set, not 0) runs kernels on CPU tensors with no driver, so
  it counts too: the CPU tests run every kernel that way.

Modules holding Triton kernels import ``triton`` and ``tl`` from :mod:`vllm.triton_utils`, so
that importing the library never needs Triton: without it, ``@triton.jit`` leaves the function
as plain Python (never launched without Triton), ``tl.constexpr(v)`` module constants stay
``v`` and other ``tl`` attributes (annotations such as ``tl.int64``) resolve to ``None``.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable, Mapping
from importlib import metadata
from importlib.util import find_spec
from typing import Any

import torch

from vllm.utils.math_utils import cdiv

__all__ = [
    "HAS_TRITON",
    "TRITON_INSTALLED",
    "TritonLanguagePlaceholder",
    "TritonPlaceholder",
    "launch_problem",
    "triton_interpreted",
]

logger = logging.getLogger(__name__)

DISTRIBUTION = "vllm-kvcache"
"""The library's installed distribution: a ``cpu`` in its version marks a Triton-CPU build."""


def triton_interpreted() -> bool:
    """Whether Triton kernels run under the interpreter (``TRITON_INTERPRET`` set, not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _is_cpu_build() -> bool:
    try:
        return "cpu" in metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        # Run from a source tree that was never installed: not a tagged build.
        return False


def _devices_pending() -> bool:
    """A blank visible-device list: a distributed worker whose devices are not assigned yet
    (Ray blanks it while an actor starts), so no driver is active for now."""
    name = "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"
    devices = os.environ.get(name)
    return devices is not None and not devices.strip()


def launch_problem(backends: Mapping[str, Any]) -> str | None:
    """Why Triton cannot launch kernels in this process, given ``triton.backends.backends``
    (backend name -> backend with a ``driver``), or ``None`` when it can (see the module
    docstring for the rules)."""
    if triton_interpreted():
        return None
    active = [
        name
        for name, backend in backends.items()
        if name != "cpu" and backend.driver and backend.driver.is_active()
    ]
    if _is_cpu_build():
        if "cpu" not in backends:
            return "this is a Triton-CPU build, but Triton has no cpu backend"
        if not active:
            return None
    if not active and _devices_pending():
        return None
    if len(active) != 1:
        return f"expected 1 active Triton driver, got {len(active)}: {active}"
    return None


def _triton_backends() -> Mapping[str, Any] | None:
    """``triton.backends.backends``, or ``None`` when Triton is not installed or does not
    import (a partial install)."""
    if find_spec("triton") is None:
        return None
    try:
        from triton.backends import backends
    except ImportError as e:
        logger.warning("Triton is installed, but triton.backends does not import: %s", e)
        return None
    return backends


def _can_launch(backends: Mapping[str, Any] | None) -> bool:
    if backends is None:
        return False
    try:
        problem = launch_problem(backends)
    except Exception as e:
        # A driver probe that raises must not make importing the library fail.
        logger.warning("Triton's driver check failed (%s); taking Triton as unable to launch", e)
        return False
    if problem is not None:
        logger.info("Triton cannot launch kernels here: %s", problem)
    return problem is None


_BACKENDS = _triton_backends()
TRITON_INSTALLED: bool = _BACKENDS is not None
"""``triton`` is installed and imports: :mod:`vllm.triton_utils` hands out the real modules."""
HAS_TRITON: bool = _can_launch(_BACKENDS)
"""Triton can launch kernels in this process (the rules of the module docstring)."""


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
