"""The ``ultraquant_4bit`` KV cache under upstream's import path: FP4 E2M1 codes with one UE8M0
scale per 32 values, K and V packed in one slot per (token, KV head). Byte layout and constants
live in :mod:`.format` (from :mod:`vllm.kv_quant.ultraquant`), the torch codec in :mod:`.reference`.
``ultraquant_store`` is re-exported here, loaded on first use as upstream does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ultraquant_store"]


def __getattr__(name: str) -> Any:
    # Lazy so importing ``.format`` alone does not load the codec.
    if name == "ultraquant_store":
        from vllm.v1.attention.ops.ultraquant.triton_store import ultraquant_store

        return ultraquant_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
