"""The KV-cache side of upstream's CPU worker (``vllm.v1.worker.cpu_worker``): how many bytes
of the worker's NUMA node go to the KV cache.

On the CPU backend the engine reserves a fraction of the node's memory for each worker
(``requested_cpu_memory``, bytes; upstream's ``--gpu-memory-utilization`` of the node's
total). The KV cache gets what the worker's own footprint (its resident set: weights and
runtime) leaves of that reservation, or exactly ``cache_config.kv_cache_memory_bytes`` when
given. The two ways to run short need opposite remedies, so they get separate errors: a
footprint above the reservation asks for a larger reservation; a node without the free memory
asks to free memory elsewhere.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Protocol

import psutil

from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
from vllm.utils.mem_utils import format_gib

__all__ = ["CPUWorker"]

logger = logging.getLogger(__name__)


class _WarmUpRunner(Protocol):
    def warming_up_model(self) -> None: ...


class CPUWorker:
    """``requested_cpu_memory``: bytes of the node reserved for this worker;
    ``model_runner``: the engine's runner, warmed up (so that its footprint is counted) before
    the budget is measured, when there is one."""

    def __init__(
        self,
        cache_config: Any,
        requested_cpu_memory: int,
        model_runner: _WarmUpRunner | None = None,
    ) -> None:
        if isinstance(requested_cpu_memory, bool) or not isinstance(requested_cpu_memory, int):
            raise TypeError(
                f"requested_cpu_memory: expected an int (bytes), got {requested_cpu_memory!r}"
            )
        if requested_cpu_memory <= 0:
            raise ValueError(
                f"requested_cpu_memory: expected a positive number of bytes, got "
                f"{requested_cpu_memory}"
            )
        self.cache_config = cache_config
        self.requested_cpu_memory = requested_cpu_memory
        self.model_runner = model_runner

    def _should_warm_up_model(self) -> bool:
        return self.model_runner is not None

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache on the node of the worker's first allowed CPU."""
        if self._should_warm_up_model():
            assert self.model_runner is not None
            self.model_runner.warming_up_model()
        node = get_allowed_cpu_list()[0].numa_node
        memory = get_memory_node_info(node)
        available = memory.available_memory
        total = format_gib(memory.total_memory)
        node_text = f"node {node} ({format_gib(available)}/{total} GiB free)"
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            if explicit > available:
                raise ValueError(
                    f"kv_cache_memory_bytes: expected at most the free memory of {node_text}, "
                    f"got {format_gib(explicit)} GiB. Decrease --kv-cache-memory-bytes or "
                    "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes."
                )
            logger.info("KV cache: %s GiB set explicitly on node %d", format_gib(explicit), node)
            return explicit
        consumed = psutil.Process(os.getpid()).memory_info().rss
        for_kv = self.requested_cpu_memory - consumed
        if for_kv <= 0:
            # Freeing memory elsewhere cannot help: only a larger reservation or an explicit
            # size can.
            in_use = math.ceil(consumed / memory.total_memory * 100) / 100
            raise ValueError(
                f"requested_cpu_memory: the worker already uses {format_gib(consumed)} GiB (model "
                f"weights and runtime), more than the {format_gib(self.requested_cpu_memory)} GiB "
                f"reserved for it on node {node}, leaving none for the KV cache. On the CPU "
                "backend `--gpu-memory-utilization` is the fraction of CPU memory reserved: "
                f"increase `--gpu-memory-utilization` to more than {in_use:.2f}, or set the "
                "KV cache size with `--kv-cache-memory-bytes` or VLLM_CPU_KVCACHE_SPACE."
            )
        if for_kv > available:
            raise ValueError(
                f"requested_cpu_memory: {format_gib(for_kv)} GiB of the "
                f"{format_gib(self.requested_cpu_memory)} GiB reserved are for the KV cache, more "
                f"than the free memory of {node_text}. Reduce CPU memory used by other "
                "processes."
            )
        logger.info(
            "KV cache: %s GiB on node %d (%s GiB reserved, %s GiB used by the worker)",
            format_gib(for_kv),
            node,
            format_gib(self.requested_cpu_memory),
            format_gib(consumed),
        )
        return for_kv
