"""Loads the compiled cache ops: the extension ``vllm/_C`` built by ``setup.py`` registers
``torch.ops._C_cache_ops`` (and upstream's ``torch.ops._C.octave_cache_store``) when this module
is imported. :mod:`vllm._custom_ops` and its MLA part
import it before they register the ops' fake kernels (which need the ops defined)."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path
from typing import Any

import torch

__all__ = ["compiled_kernel", "extension_path", "load_extension"]


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


def compiled_kernel(name: str, device: torch.device) -> Any | None:
    """The extension's op ``name`` (``<namespace>::<op>``; a bare op name is
    ``_C_cache_ops``'s) when it has a kernel for ``device``, else None (an extension built
    without the op, or a CUDA tensor with a CPU-only build)."""
    namespace, _, op_name = name.rpartition("::")
    try:
        op = getattr(getattr(torch.ops, namespace or "_C_cache_ops"), op_name).default
    except (AttributeError, RuntimeError):
        return None
    key = "CUDA" if device.type == "cuda" else "CPU"
    return op if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key) else None


load_extension()
