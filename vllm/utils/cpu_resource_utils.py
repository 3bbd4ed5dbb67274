"""Host CPU and memory resources for CPU workers (upstream v0.33's ``cpu_resource_utils``):
the logical CPUs this process may run on, NUMA memory nodes and their free memory (bytes),
and the container (cgroup) memory limit.

Every reader degrades to a safe answer where the platform does not expose the information
(macOS, boards without NUMA, hosts without cgroup limits): one NUMA node, the system-wide
memory numbers, no limit.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

import psutil

logger = logging.getLogger(__name__)

__all__ = [
    "DEVICE_CONTROL_ENV_VAR",
    "LogicalCPUInfo",
    "MemoryNodeInfo",
    "check_cgroup_memory_available",
    "get_allowed_cpu_list",
    "get_cgroup_memory_limit",
    "get_cgroup_memory_usage",
    "get_memory_affinity",
    "get_memory_node_info",
    "get_visible_memory_node",
    "parse_id_list",
]

DEVICE_CONTROL_ENV_VAR = "CPU_VISIBLE_MEMORY_NODES"
"""Comma-separated NUMA node ids a CPU worker may use (like ``CUDA_VISIBLE_DEVICES``)."""

_CGROUP_V2_LIMIT = "/sys/fs/cgroup/memory.max"
_CGROUP_V2_USAGE = "/sys/fs/cgroup/memory.current"
_CGROUP_V1_LIMIT = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
_CGROUP_V1_USAGE = "/sys/fs/cgroup/memory/memory.usage_in_bytes"
_CGROUP_V1_UNLIMITED = 1 << 62
"""cgroup v1 reports "no limit" as a value near the page counter's maximum."""


@dataclass
class LogicalCPUInfo:
    """One logical CPU: its id, the physical core it runs on and its NUMA node (-1: unknown)."""

    id: int = -1
    physical_core: int = -1
    numa_node: int = -1

    @classmethod
    def _int(cls, value: Any) -> int:
        """``value`` as an int, -1 when it is not one (lscpu prints ``-`` for unknown)."""
        try:
            return int(value)
        except (TypeError, ValueError):
            return -1

    @staticmethod
    def json_decoder(obj_dict: dict[str, Any]) -> Any:
        """``json.loads`` hook: an lscpu CPU entry (keys ``cpu``, ``core``, ``node``) becomes a
        :class:`LogicalCPUInfo`; any other object is returned as is."""
        keys = ("cpu", "core", "node")
        if any(obj_dict.get(k) is None for k in keys):
            return obj_dict
        cpu, core, node = (LogicalCPUInfo._int(obj_dict[k]) for k in keys)
        return LogicalCPUInfo(id=cpu, physical_core=core, numa_node=node)


@dataclass
class MemoryNodeInfo:
    """Memory of one NUMA node, bytes (-1: unknown)."""

    total_memory: int = -1
    available_memory: int = -1


def _read_int_file(path: str) -> int | None:
    """The int a sysfs/cgroup file holds; None when it is missing, empty, ``max`` or not an
    int."""
    try:
        with open(path) as f:
            value = f.read().strip()
        return int(value) if value and value != "max" else None
    except (OSError, ValueError):
        return None


def _cgroup_v1_limit() -> int | None:
    limit = _read_int_file(_CGROUP_V1_LIMIT)
    return limit if limit is not None and limit < _CGROUP_V1_UNLIMITED else None


@cache
def get_cgroup_memory_limit() -> int | None:
    """The container's memory limit in bytes (cgroup v2, else v1); None off Linux or without a
    limit. Cached: the limit does not change while the process runs."""
    if sys.platform != "linux":
        return None
    limit = _read_int_file(_CGROUP_V2_LIMIT)
    return limit if limit is not None else _cgroup_v1_limit()


def get_cgroup_memory_usage() -> int | None:
    """The container's current memory usage in bytes, read afresh on every call; None off
    Linux or without a limited cgroup."""
    if sys.platform != "linux":
        return None
    if _read_int_file(_CGROUP_V2_LIMIT) is not None:
        return _read_int_file(_CGROUP_V2_USAGE)
    if _cgroup_v1_limit() is not None:
        return _read_int_file(_CGROUP_V1_USAGE)
    return None


def check_cgroup_memory_available(required_bytes: int, allocation_name: str) -> None:
    """Log the container's memory headroom before allocating ``required_bytes`` bytes for
    ``allocation_name``: a warning when the headroom is short (the allocation still goes ahead:
    part of the usage may be reclaimable page cache), debug otherwise; nothing when the limit or
    the usage cannot be read."""
    if isinstance(required_bytes, bool) or not isinstance(required_bytes, int):
        raise TypeError(f"required_bytes: expected an int (bytes), got {required_bytes!r}")
    limit = get_cgroup_memory_limit()
    usage = get_cgroup_memory_usage()
    if limit is None or usage is None:
        return
    available = max(0, limit - usage)
    remaining = available - required_bytes
    mib = 1 << 20
    log = logger.debug if remaining >= 0 else logger.warning
    log(
        "Cgroup memory preflight for %s: %.0f MiB required, %.0f MiB in use, %.0f MiB available "
        "of a %.0f MiB limit, %.0f MiB left after the allocation%s.",
        allocation_name,
        required_bytes / mib,
        usage / mib,
        available / mib,
        limit / mib,
        remaining / mib,
        ""
        if remaining >= 0
        else "; the headroom is short, allocating anyway (part of the usage may be reclaimable)",
    )


def parse_id_list(raw_str: str) -> list[int]:
    """The sorted distinct ids of a kernel id list such as ``"0-2,4,7-8"``."""
    ids: set[int] = set()
    for part in filter(None, (p.strip() for p in raw_str.split(","))):
        start, sep, end = part.partition("-")
        try:
            ids.update(range(int(start), int(end) + 1) if sep else (int(start),))
        except ValueError as err:
            raise ValueError(
                f"raw_str: expected ids or ranges like '0-2,4', got {raw_str!r}"
            ) from err
    return sorted(ids)


def get_memory_affinity(pid: int = 0) -> list[int]:
    """The NUMA nodes process ``pid`` (0: this one) may allocate on (``Mems_allowed_list``);
    empty when the kernel does not say."""
    pid = pid or os.getpid()
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Mems_allowed_list:"):
                return parse_id_list(line.split(":", 1)[1].strip())
    return []


def _system_memory() -> MemoryNodeInfo:
    vm = psutil.virtual_memory()
    return MemoryNodeInfo(total_memory=vm.total, available_memory=vm.available)


def get_memory_node_info(node_id: int = 0) -> MemoryNodeInfo:
    """Total and available memory (bytes) of NUMA node ``node_id``: free plus page cache plus
    reclaimable slab, clamped to the container's limit (cgroups limit the whole container, not
    a node). The system-wide numbers where nodes are not exposed."""
    if sys.platform == "darwin":
        return _system_memory()
    path = f"/sys/devices/system/node/node{node_id}/meminfo"
    if not os.path.exists(path):
        return _system_memory()
    meminfo: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            # "Node 0 MemTotal:  97421888 kB"
            parts = line.split()
            if len(parts) >= 4:
                meminfo[parts[2].rstrip(":")] = int(parts[3]) * 1024
    total = meminfo["MemTotal"]
    available = sum(
        meminfo[k] for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
    )
    limit = get_cgroup_memory_limit()
    if limit is not None and limit < total:
        total = limit
        available = max(0, min(available, limit - (get_cgroup_memory_usage() or 0)))
    return MemoryNodeInfo(total_memory=total, available_memory=available)


def get_visible_memory_node(assigned_node_ids: list[int] | None = None) -> list[int]:
    """The NUMA nodes this process may use: ``assigned_node_ids`` (a data-parallel rank's
    nodes) when given, else those :data:`DEVICE_CONTROL_ENV_VAR` names, else every node it
    may allocate on; always within its memory affinity (``VLLM_CPU_SIM_MULTI_NUMA``: the
    affinity as is)."""
    if sys.platform == "darwin":
        return [0]
    allowed = get_memory_affinity()
    if "VLLM_CPU_SIM_MULTI_NUMA" in os.environ:
        return allowed
    if assigned_node_ids is None:
        raw = os.environ.get(DEVICE_CONTROL_ENV_VAR, "")
        if not raw:
            return allowed
        assigned_node_ids = [int(s) for s in raw.split(",")]
    return [node for node in assigned_node_ids if node in allowed]


@cache
def _synthesize_cpu_list() -> list[LogicalCPUInfo]:
    """Every logical CPU its own core on node 0: the topology where lscpu gives none."""
    count = os.cpu_count() or 1
    return [LogicalCPUInfo(i, i, 0) for i in range(count)]


_BARE_NODE = re.compile(r'"node":\s*-\s*(,|\n|\})')
_BARE_CPU_OR_CORE = re.compile(r'("(?:cpu|core)":\s*)-\s*(,|\n|\})')
_BARE_BOOK_OR_SOCKET = re.compile(r'"(book|socket)":\s*-\s*(,|\n|\})')


def _s390x_cpu_list(lscpu_output: str) -> list[LogicalCPUInfo] | None:
    """s390x: CPUs grouped by book, else socket, when there are several (the ``numa_node`` of
    the entries); None when there is only one of each."""
    raw = json.loads(_BARE_BOOK_OR_SOCKET.sub(r'"\1": 0\2', lscpu_output))["cpus"]
    for key in ("book", "socket"):
        if len({LogicalCPUInfo._int(e.get(key, -1)) for e in raw} - {-1}) > 1:
            cpus = [
                LogicalCPUInfo(*(LogicalCPUInfo._int(e.get(k, -1)) for k in ("cpu", "core", key)))
                for e in raw
            ]
            valid = [c for c in cpus if -1 not in (c.id, c.physical_core, c.numa_node)]
            return valid or _synthesize_cpu_list()
    return None


def _get_cpu_list() -> list[LogicalCPUInfo]:
    """The online logical CPUs from ``lscpu``; a synthesized flat list where lscpu gives no
    usable topology (macOS, some RISC-V boards)."""
    if sys.platform == "darwin":
        return _synthesize_cpu_list()
    s390x = platform.machine() == "s390x"
    command = (
        ["lscpu", "-J", "-e=CPU,CORE,NODE,SOCKET,BOOK"]
        if s390x
        else ["lscpu", "--json", "--extended=CPU,CORE,NODE", "--online"]
    )
    output = subprocess.check_output(command, text=True)
    # Without NUMA lscpu prints a bare "-" node: node 0. A bare "-" cpu or core is quoted so
    # the JSON parses; it decodes to -1 and is dropped below.
    output = _BARE_NODE.sub(r'"node": 0\1', output)
    output = _BARE_CPU_OR_CORE.sub(r'\1"-"\2', output)
    if s390x and (grouped := _s390x_cpu_list(output)) is not None:
        return grouped
    cpus = json.loads(output, object_hook=LogicalCPUInfo.json_decoder)["cpus"]
    valid = [
        c
        for c in cpus
        if isinstance(c, LogicalCPUInfo) and -1 not in (c.id, c.physical_core, c.numa_node)
    ]
    return valid or _synthesize_cpu_list()


def get_allowed_cpu_list() -> list[LogicalCPUInfo]:
    """The logical CPUs this process may run on (its affinity, on Linux)."""
    cpus = _get_cpu_list()
    if sys.platform != "linux":
        return cpus
    allowed = os.sched_getaffinity(0)
    return [c for c in cpus if c.id in allowed]
