"""Cross-layer KV sharing: sharing layers join their target's group and read its cache, the
same tensor, allocated and counted once (upstream's two cases run from its own file,
tests/v1/core/test_kv_sharing.py, through tools/run_upstream_tests.py)."""

from __future__ import annotations

import pytest
from kv_cache_test_utils import attn_spec, one_group

from vllm.v1.attention.backends import ReferenceAttentionBackend
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches
from vllm.v1.worker.utils import add_kv_sharing_layers_to_kv_cache_groups

SPEC = attn_spec(num_kv_heads=2, head_size=64)
PAGE = SPEC.page_size_bytes


def test_sharing_layers_join_their_targets_group_and_the_runner_set() -> None:
    groups = [KVCacheGroupSpec(["a"], SPEC), KVCacheGroupSpec(["b"], SPEC)]
    runner_only: set[str] = set()
    add_kv_sharing_layers_to_kv_cache_groups({"c": "b", "d": "a"}, groups, runner_only)
    assert [g.layer_names for g in groups] == [["a", "d"], ["b", "c"]]
    assert runner_only == {"c", "d"}


@pytest.mark.parametrize(
    ("shared", "message"),
    [
        ({"c": "x"}, r"shared_kv_cache_layers\['c'\]: expected a target layer that owns a cache"),
        ({"b": "a"}, r"shared_kv_cache_layers\['b'\]: expected a layer without a cache of its"),
    ],
)
def test_bad_sharing_changes_no_group(shared: dict[str, str], message: str) -> None:
    groups = [KVCacheGroupSpec(["a", "b"], SPEC)]
    with pytest.raises(ValueError, match=message):
        add_kv_sharing_layers_to_kv_cache_groups({"z": "a", **shared}, groups)
    assert groups[0].layer_names == ["a", "b"]


@pytest.mark.parametrize("listed", [False, True])
def test_init_kv_cache_gives_a_sharing_layer_its_targets_tensor(listed: bool) -> None:
    config = one_group(SPEC, 4 * PAGE, layers=("a", "b"))
    if listed:  # the runner has already added the sharing layer to the group
        add_kv_sharing_layers_to_kv_cache_groups({"c": "a"}, config.kv_cache_groups)
    caches = init_layer_kv_caches(
        config, [ReferenceAttentionBackend], "cpu", shared_kv_cache_layers={"c": "a"}
    )
    assert caches["c"] is caches["a"] and caches["b"] is not caches["a"]
    buffers = {t.untyped_storage().data_ptr() for t in (caches["a"], caches["b"])}
    assert len(buffers) == 2  # one buffer per owning layer, none for "c"


def test_init_kv_cache_refuses_a_sharing_layer_with_its_own_buffer() -> None:
    config = one_group(SPEC, 4 * PAGE, layers=("a", "b"))
    with pytest.raises(ValueError, match=r"shared_kv_cache_layers\['b'\]: expected a layer"):
        init_layer_kv_caches(
            config, [ReferenceAttentionBackend], "cpu", shared_kv_cache_layers={"b": "a"}
        )
