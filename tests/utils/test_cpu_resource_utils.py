"""vllm.utils.cpu_resource_utils: parsing and fallbacks, without depending on the host."""

import json
import logging

import pytest

from vllm.utils import cpu_resource_utils as cru
from vllm.utils.cpu_resource_utils import LogicalCPUInfo, MemoryNodeInfo


def test_parse_id_list() -> None:
    assert cru.parse_id_list("0-2,4,7-8") == [0, 1, 2, 4, 7, 8]
    assert cru.parse_id_list("3,1,1-2") == [1, 2, 3]
    assert cru.parse_id_list("") == []
    with pytest.raises(ValueError, match="raw_str: expected ids or ranges"):
        cru.parse_id_list("0-x")


def test_json_decoder() -> None:
    text = '{"cpus": [{"cpu": "0", "core": "0", "node": "1"}, {"cpu": "-", "core": 1, "node": 0}]}'
    cpus = json.loads(text, object_hook=LogicalCPUInfo.json_decoder)["cpus"]
    assert cpus == [LogicalCPUInfo(0, 0, 1), LogicalCPUInfo(-1, 1, 0)]
    assert LogicalCPUInfo.json_decoder({"cpu": 0}) == {"cpu": 0}


def test_lscpu_without_numa_or_cores(monkeypatch) -> None:
    output = '{"cpus": [{"cpu": 0, "core": 0, "node": -}, {"cpu": 1, "core": -, "node": -}]}'
    monkeypatch.setattr(cru.sys, "platform", "linux")
    monkeypatch.setattr(cru.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cru.subprocess, "check_output", lambda *a, **k: output)
    # The bare "-" node reads as node 0; the CPU without a core is dropped.
    assert cru._get_cpu_list() == [LogicalCPUInfo(0, 0, 0)]
    monkeypatch.setattr(
        cru.subprocess, "check_output", lambda *a, **k: '{"cpus": [{"cpu": -, "core": -}]}'
    )
    assert cru._get_cpu_list() == cru._synthesize_cpu_list()


def test_read_int_file(tmp_path) -> None:
    f = tmp_path / "v"
    f.write_text("max\n")
    assert cru._read_int_file(str(f)) is None
    f.write_text(" 42\n")
    assert cru._read_int_file(str(f)) == 42
    assert cru._read_int_file(str(tmp_path / "missing")) is None


def test_memory_node_info_falls_back_to_system_memory(monkeypatch) -> None:
    monkeypatch.setattr(cru.sys, "platform", "linux")
    monkeypatch.setattr(cru.os.path, "exists", lambda _: False)
    info = cru.get_memory_node_info(7)
    assert isinstance(info, MemoryNodeInfo) and info.total_memory > 0


def test_memory_node_info_clamps_to_the_cgroup_limit(monkeypatch, tmp_path) -> None:
    kib = 1024
    lines = ["MemTotal: 1000", "MemFree: 300", "Active(file): 50", "Inactive(file): 50"]
    lines.append("SReclaimable: 100")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("".join(f"Node 0 {line} kB\n" for line in lines))
    real_open = open
    monkeypatch.setattr(cru.sys, "platform", "linux")
    monkeypatch.setattr(cru.os.path, "exists", lambda _: True)
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(meminfo if "meminfo" in str(path) else path, *a, **k),
    )
    monkeypatch.setattr(cru, "get_cgroup_memory_limit", lambda: 600 * kib)
    monkeypatch.setattr(cru, "get_cgroup_memory_usage", lambda: 350 * kib)
    assert cru.get_memory_node_info(0) == MemoryNodeInfo(600 * kib, 250 * kib)
    monkeypatch.setattr(cru, "get_cgroup_memory_limit", lambda: None)
    assert cru.get_memory_node_info(0) == MemoryNodeInfo(1000 * kib, 500 * kib)


def test_visible_memory_nodes(monkeypatch) -> None:
    monkeypatch.setattr(cru.sys, "platform", "linux")
    monkeypatch.setattr(cru, "get_memory_affinity", lambda: [0, 1])
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA", raising=False)
    monkeypatch.setenv(cru.DEVICE_CONTROL_ENV_VAR, "1,3")
    assert cru.get_visible_memory_node() == [1]
    assert cru.get_visible_memory_node([0, 2]) == [0]  # the assignment beats the variable
    monkeypatch.setenv(cru.DEVICE_CONTROL_ENV_VAR, "")
    assert cru.get_visible_memory_node() == [0, 1]


def test_cgroup_preflight_logs(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cru, "get_cgroup_memory_limit", lambda: 1 << 30)
    monkeypatch.setattr(cru, "get_cgroup_memory_usage", lambda: 1 << 29)
    with caplog.at_level(logging.DEBUG, logger=cru.__name__):
        cru.check_cgroup_memory_available(1 << 28, "kv cache")
        assert caplog.records[-1].levelno == logging.DEBUG
        cru.check_cgroup_memory_available(1 << 30, "kv cache")
        assert caplog.records[-1].levelno == logging.WARNING
    assert "short" in caplog.records[-1].getMessage()
    with pytest.raises(TypeError, match="required_bytes"):
        cru.check_cgroup_memory_available(1.5, "kv cache")  # type: ignore[arg-type]
    monkeypatch.setattr(cru, "get_cgroup_memory_usage", lambda: None)
    caplog.clear()
    cru.check_cgroup_memory_available(1 << 40, "kv cache")
    assert not caplog.records


def test_allowed_cpus_follow_the_affinity(monkeypatch) -> None:
    monkeypatch.setattr(cru.sys, "platform", "linux")
    monkeypatch.setattr(cru, "_get_cpu_list", lambda: [LogicalCPUInfo(i, i, 0) for i in range(4)])
    monkeypatch.setattr(cru.os, "sched_getaffinity", lambda _: {1, 3})
    assert [c.id for c in cru.get_allowed_cpu_list()] == [1, 3]
