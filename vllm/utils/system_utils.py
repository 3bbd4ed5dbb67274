"""Process-level helpers (upstream's ``vllm.utils.system_utils``, reduced)."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext

__all__ = ["get_mp_context"]

MP_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_MP_METHODS = ("fork", "spawn", "forkserver")


def get_mp_context() -> BaseContext:
    """The multiprocessing context named by ``VLLM_WORKER_MULTIPROC_METHOD`` (default
    ``fork``); an unknown method is a ``ValueError`` naming the variable."""
    method = os.environ.get(MP_METHOD_ENV, "fork")
    if method not in _MP_METHODS:
        raise ValueError(f"{MP_METHOD_ENV}: expected one of {_MP_METHODS}, got {method!r}")
    return multiprocessing.get_context(method)
