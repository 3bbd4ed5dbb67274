"""TieringOffloadingSpec: created by name, a tiering manager over the engine's shared region,
worker handlers on the worker's cells of it, byte-exact GPU -> region -> GPU moves."""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from tiering_test_utils import stub_spec

from vllm.config.kv_transfer import KVTransferConfig
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

try:
    from vllm import _custom_ops as ops
except ImportError:  # pragma: no cover - the extension is built in CI
    pytest.skip("vllm._custom_ops (the compiled extension) is not built", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

CTX = ReqContext(req_id="r")


def make_spec(**extra: Any) -> TieringOffloadingSpec:
    base = stub_spec()
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", **extra},
    )
    config = dataclasses.replace(
        base.vllm_config, kv_transfer_config=transfer, instance_id=f"test_{uuid.uuid4().hex}"
    )
    spec = OffloadingSpecFactory.create_spec(config, base.kv_cache_config)
    assert isinstance(spec, TieringOffloadingSpec)
    spec.swap_blocks = ops.swap_blocks
    return spec


def run(handler, job_id: int, spec) -> None:
    assert handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [(job_id, True)]


def test_store_and_load_through_the_shared_region() -> None:
    spec = make_spec(num_cpu_blocks=4, secondary_tiers=[{"type": "example"}])
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager) and spec.get_manager() is manager
    assert [t.tier_type for t in manager.secondary_tiers] == ["example"]
    page = spec.cpu_page_size_per_worker
    gpu = torch.randint(0, 256, (6, page), dtype=torch.uint8, generator=torch.Generator())
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(gpu, page)], [[CanonicalKVCacheRef(0, page)]])
    routes = [(src.__name__, dst.__name__) for src, dst, _ in spec.get_handlers(kv)]
    assert routes == [
        ("GPULoadStoreSpec", "CPULoadStoreSpec"),
        ("CPULoadStoreSpec", "GPULoadStoreSpec"),
    ]
    handlers = spec.handlers
    assert handlers is not None
    region_path = f"/dev/shm/vllm_offload_{spec.vllm_config.instance_id}.mmap"
    try:
        keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(3)]
        out = manager.prepare_store(keys, CTX)
        assert out is not None and list(out.keys_to_store) == keys
        run(
            handlers.gpu_to_cpu_handler,
            1,
            (GPULoadStoreSpec([5, 0, 2], (3,), (0,)), out.store_spec),
        )
        manager.complete_store(keys, CTX)
        rows = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8)
        rows = rows.reshape(4, page)
        for row, block in zip(out.store_spec.block_ids, [5, 0, 2], strict=True):
            assert np.array_equal(rows[row], gpu[block].numpy())
        expected = gpu[[5, 2]].clone()
        gpu.zero_()
        load = manager.prepare_load([keys[0], keys[2]], CTX)
        run(handlers.cpu_to_gpu_handler, 2, (load, GPULoadStoreSpec([1, 3], (2,), (0,))))
        manager.complete_load([keys[0], keys[2]], CTX)
        assert torch.equal(gpu[[1, 3]], expected) and not gpu[[0, 2, 4, 5]].any()
        del rows
    finally:
        handlers.shutdown()
        manager.shutdown()
    assert not os.path.exists(region_path)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"secondary_tiers": {"type": "example"}}, "expected a list of tier configurations"),
        ({"store_threshold": 2}, "not supported with tiering"),
    ],
)
def test_bad_configs_are_rejected(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_spec(num_cpu_blocks=4, **extra)


def test_a_failing_tier_releases_the_region() -> None:
    spec = make_spec(num_cpu_blocks=2, secondary_tiers=[{"type": "no-such-tier"}])
    with pytest.raises(Exception, match="no-such-tier"):
        spec.get_manager()
    assert not os.path.exists(f"/dev/shm/vllm_offload_{spec.vllm_config.instance_id}.mmap")
