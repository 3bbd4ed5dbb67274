"""vllm-kvcache: the KV-cache subsystem of a vLLM-style inference engine."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Upstream's top-level names that the library ships, imported on first use (as upstream does) so
# that `import vllm` stays cheap.
_LAZY_EXPORTS = {"SamplingParams": "vllm.sampling_params"}

__all__ = ["SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
