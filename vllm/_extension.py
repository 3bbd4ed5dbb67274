"""Loads the compiled cache ops: the extension ``vllm/_C`` built by ``setup.py`` registers
``torch.ops._C_cache_ops`` when this module is imported. :mod:`vllm._custom_ops` and its MLA part
import it before they register the ops' fake kernels (which need the ops defined)."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import torch

__all__ = ["extension_path", "load_extension"]


def extension_path() -> Path | None:
    """The built extension's file in the package folder, or None when it is not built."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_C{suffix}"
        if candidate.is_file():
            return candidate
    return None


def load_extension() -> None:
    """Loads the extension into torch (``ImportError`` saying how to build it when absent)."""
    path = extension_path()
    if path is None:
        raise ImportError(
            "vllm._C (the compiled cache ops) is not built: run "
            "`pip install --no-build-isolation -e .` in the repository root (needs torch, "
            "cmake >= 3.22, ninja and a C++20 compiler)"
        )
    torch.ops.load_library(str(path))


load_extension()
