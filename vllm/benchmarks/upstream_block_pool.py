"""Load upstream vLLM's block pool from an unpacked sdist, beside this library, for the block
pool benchmark (:mod:`vllm.benchmarks.block_pool`).

Upstream's ``vllm/v1/core/kv_cache_utils.py``, ``kv_cache_metrics.py`` and ``block_pool.py`` are
executed from ``<sdist>/vllm/v1/core/`` under their own module names (``upstream_vllm.*``). Their
``vllm.*`` imports are answered by this library's modules of the same names, except those this
library does not have, which get stand-ins for the load only: ``vllm.envs`` (the one flag the
block code reads, off), ``vllm.logger`` (``logging.getLogger``), ``vllm.utils.mem_utils`` and
``vllm.v1.utils`` (the two helpers the planning functions and prompt-embeds hashing name).
While upstream's ``block_pool`` loads, ``vllm.v1.core.kv_cache_utils`` and
``kv_cache_metrics`` name upstream's own modules, so its pool runs on upstream's blocks, free
queue and hash helpers. Events use this library's records (upstream's need ``msgspec`` and
``zmq``); the benchmark runs with events off.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.v1.core.block_hashing import tensor_data

__all__ = ["UpstreamBlockPool", "load_upstream"]


@dataclass(frozen=True)
class UpstreamBlockPool:
    """Upstream's loaded modules and the stand-ins they were loaded with."""

    kv_cache_utils: types.ModuleType
    block_pool: types.ModuleType
    stand_ins: list[str]


def _stand_ins() -> dict[str, types.ModuleType]:
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False  # type: ignore[attr-defined]
    logger = types.ModuleType("vllm.logger")
    logger.init_logger = logging.getLogger  # type: ignore[attr-defined]
    mem_utils = types.ModuleType("vllm.utils.mem_utils")
    mem_utils.format_gib = lambda b: f"{b / (1 << 30):.2f}"  # type: ignore[attr-defined]
    v1_utils = types.ModuleType("vllm.v1.utils")
    v1_utils.tensor_data = tensor_data  # type: ignore[attr-defined]
    return {m.__name__: m for m in (envs, logger, mem_utils, v1_utils)}


@contextmanager
def _modules(overrides: dict[str, types.ModuleType]) -> Iterator[None]:
    """``sys.modules`` with ``overrides`` in place, restored afterwards."""
    saved = {name: sys.modules.get(name) for name in overrides}
    sys.modules.update(overrides)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _exec(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def load_upstream(sdist: str | Path) -> UpstreamBlockPool:
    """Upstream's block pool from the unpacked sdist at ``sdist`` (the folder holding
    ``vllm/``). Raises ``ImportError`` (with the reason) when it cannot be loaded."""
    core = Path(sdist) / "vllm" / "v1" / "core"
    files = {n: core / f"{n}.py" for n in ("kv_cache_utils", "kv_cache_metrics", "block_pool")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ImportError(f"sdist: expected upstream's block pool sources, got no {missing}")
    stand_ins = {n: m for n, m in _stand_ins().items() if importlib.util.find_spec(n) is None}
    loaded: dict[str, Any] = {}
    try:
        with _modules(stand_ins):
            loaded["kv_cache_utils"] = _exec(
                files["kv_cache_utils"], "upstream_vllm.v1.core.kv_cache_utils"
            )
            with _modules({"vllm.v1.core.kv_cache_utils": loaded["kv_cache_utils"]}):
                loaded["kv_cache_metrics"] = _exec(
                    files["kv_cache_metrics"], "upstream_vllm.v1.core.kv_cache_metrics"
                )
                with _modules({"vllm.v1.core.kv_cache_metrics": loaded["kv_cache_metrics"]}):
                    loaded["block_pool"] = _exec(
                        files["block_pool"], "upstream_vllm.v1.core.block_pool"
                    )
    except Exception as e:  # any failure of upstream's module code means "cannot import"
        raise ImportError(f"upstream block pool from {sdist}: {type(e).__name__}: {e}") from e
    return UpstreamBlockPool(loaded["kv_cache_utils"], loaded["block_pool"], sorted(stand_ins))
