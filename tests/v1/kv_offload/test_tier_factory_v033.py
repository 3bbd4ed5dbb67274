"""v0.33's tier lookup (out-of-tree tiers by ``module_path``, v0.22's ``fs_python`` name) and
the cache-hit source a tier's medium gives."""

from __future__ import annotations

import pytest
import torch
from tiering_test_utils import stub_spec

from vllm.v1.kv_offload.base import Medium
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory, TierClassError
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource


def test_fs_python_still_names_the_fs_tier(tmp_path) -> None:
    config = {"type": "fs_python", "root_dir": str(tmp_path), "n_read_threads": 1}
    assert SecondaryTierFactory.get_tier_class(config) is FileSystemTierManager
    assert "fs_python" not in SecondaryTierFactory._registry


def test_module_path_loads_an_unregistered_tier_and_config_is_left_alone() -> None:
    config = {
        "type": "ExampleSecondaryTierManager",
        "module_path": "vllm.v1.kv_offload.tiering.example.manager",
        "custom_param": 3,
    }
    view = memoryview(torch.zeros((2, 8), dtype=torch.int8).numpy())
    tier = SecondaryTierFactory.create_secondary_tier(config, view, stub_spec())
    assert tier.tier_type == "ExampleSecondaryTierManager"
    assert tier.config_info() == {"example_info": 3}
    assert "module_path" in config and "ExampleSecondaryTierManager" not in (
        SecondaryTierFactory._registry
    )


@pytest.mark.parametrize("name", ["Medium", "SecondaryTierFactory"])
def test_a_module_path_name_that_is_no_tier_class_fails(name) -> None:
    module = "vllm.v1.kv_offload.tiering.factory" if name != "Medium" else "vllm.v1.kv_offload.base"
    with pytest.raises(TierClassError, match="expected a SecondaryTierManager subclass"):
        SecondaryTierFactory.get_tier_class({"type": name, "module_path": module})


def test_hit_source_follows_the_medium_unless_set() -> None:
    class Disk(SecondaryTierManager):
        medium = Medium.STORAGE

    class Peer(Disk):
        cache_hit_source = CacheHitSource.P2P

    class Unknown(SecondaryTierManager):
        pass

    assert Disk.cache_hit_source is CacheHitSource.DISK
    assert Peer.cache_hit_source is CacheHitSource.P2P
    assert Unknown.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED


def test_outermost_source_is_the_farthest_tier() -> None:
    s = CacheHitSource
    assert s.outermost([s.DISK, s.HOST]) is s.DISK
    assert s.outermost([s.EXTERNAL_UNSPECIFIED, s.DEVICE]) is s.EXTERNAL_UNSPECIFIED
    assert s.outermost([s.DEVICE]) is s.DEVICE
    with pytest.raises(ValueError):
        s.outermost([])
