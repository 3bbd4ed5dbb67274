"""Offloading the KV cache of every shipped preset as the planner lays it out.

The planner gives hybrid models groups of different GPU block sizes (DeepSeek-V4: 256 to 32768
tokens; Qwen3-Next, Nemotron-H: Mamba + attention); the offload spec and handlers must accept
every plan (an offloaded block mirrors one GPU block id) and move pages byte for byte.

The KV-cache buffers are ``torch.empty`` (untouched pages cost no memory) registered as raw byte
buffers, one per ``KVCacheTensor``; the round trips touch only the pages they move.
"""

from __future__ import annotations

import pytest
import torch
from kv_offload_test_utils import HAVE_EXTENSION, reference_swap_blocks

from vllm.config import CacheConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.model_presets import available_presets
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.worker.page_views import kv_cache_tensor_page_sizes

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

MAX_MODEL_LEN = 1024
MAX_NUM_BATCHED_TOKENS = 256
REQUESTS = 2
NUM_CPU_BLOCKS = 4
ROUND_TRIP_PRESETS = ["gpt-oss-20b", "qwen3-next-80b-a3b-instruct", "deepseek-v4-flash"]


def small_plan(preset: str) -> KVCacheConfig:
    """The preset's plan with a budget of ``REQUESTS`` requests of ``MAX_MODEL_LEN`` tokens."""
    kwargs = {"max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS}
    probe = kv_cache_utils.plan_kv_cache(preset, None, 1 << 40, **kwargs)
    budget = probe.bytes_per_block * probe.blocks_per_request * REQUESTS
    plan = kv_cache_utils.plan_kv_cache(preset, None, budget, **kwargs)
    assert plan.max_concurrency >= REQUESTS
    return plan.kv_cache_config


def register(config: KVCacheConfig) -> tuple[OffloadingConnectorWorker, list[torch.Tensor]]:
    raw = [torch.empty(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    kv_caches = {
        name: r for t, r in zip(config.kv_cache_tensors, raw, strict=True) for name in t.shared_by
    }
    transfer = KVTransferConfig(kv_connector_extra_config={"num_cpu_blocks": NUM_CPU_BLOCKS})
    spec = CPUOffloadingSpec(
        VllmConfig(cache_config=CacheConfig(), kv_transfer_config=transfer),
        config,
        swap_blocks=None if HAVE_EXTENSION else reference_swap_blocks,
    )
    connector = OffloadingConnectorWorker(spec)
    connector.register_kv_caches(kv_caches, config)
    return connector, raw


def page(raw: torch.Tensor, page_size: int, block: int) -> torch.Tensor:
    return raw.view(torch.uint8)[block * page_size : (block + 1) * page_size]


@pytest.mark.parametrize("preset", available_presets())
def test_every_preset_plan_builds_offload_spec_and_handlers(preset: str) -> None:
    config = small_plan(preset)
    block_sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    connector, _ = register(config)
    spec = connector.spec
    assert isinstance(spec, CPUOffloadingSpec)
    # One GPU block id per offloaded block, even with mixed group block sizes.
    assert spec.block_size_factor == 1
    assert spec.offloaded_block_size == max(block_sizes)
    page_sizes = kv_cache_tensor_page_sizes(config)
    assert spec.cpu_page_size_per_worker == sum(page_sizes)
    handlers = spec.handlers
    assert handlers is not None
    assert handlers.num_gpu_blocks == config.num_blocks
    assert [t.shape for t in handlers.gpu_tensors] == [(config.num_blocks, p) for p in page_sizes]
    assert [t.shape for t in handlers.cpu_tensors] == [(NUM_CPU_BLOCKS, p) for p in page_sizes]
    connector.shutdown()


@pytest.mark.parametrize("preset", ROUND_TRIP_PRESETS)
def test_preset_round_trip_is_byte_exact(preset: str) -> None:
    """Store three GPU blocks, overwrite them, load them into other blocks: every page of every
    buffer moves bit for bit; pages not loaded into are unchanged."""
    config = small_plan(preset)
    if preset == "deepseek-v4-flash":
        assert len({g.kv_cache_spec.block_size for g in config.kv_cache_groups}) > 1
    connector, raw = register(config)
    page_sizes = kv_cache_tensor_page_sizes(config)
    n = config.num_blocks
    stored, cpu_blocks, load_to, untouched = [0, n - 1, 3], [2, 0, 3], [5, 1, n - 2], 4
    assert n >= 7 and len({*stored, *load_to, untouched}) == 7
    g = torch.Generator().manual_seed(11)

    def fill(blocks: list[int]) -> list[list[torch.Tensor]]:
        """Random bytes into ``blocks`` of every buffer; returns [buffer][block] copies."""
        out = []
        for r, p in zip(raw, page_sizes, strict=True):
            pages = []
            for b in blocks:
                data = torch.randint(0, 256, (p,), dtype=torch.uint8, generator=g)
                page(r, p, b).copy_(data)
                pages.append(data)
            out.append(pages)
        return out

    original = fill(stored)
    sentinel = fill([untouched])
    store = connector.store(stored, cpu_blocks)
    connector.wait([store])
    clobbered = fill(stored)  # the GPU blocks are reused once the store has finished
    load = connector.load(cpu_blocks, load_to)
    connector.wait([load])
    assert [(r.job_id, r.success) for r in connector.get_finished()] == [
        (store, True),
        (load, True),
    ]
    handlers = connector.spec.handlers
    assert handlers is not None
    for i, (r, p) in enumerate(zip(raw, page_sizes, strict=True)):
        for j, (src, cpu, dst) in enumerate(zip(stored, cpu_blocks, load_to, strict=True)):
            assert torch.equal(handlers.cpu_tensors[i][cpu], original[i][j]), (i, src)
            assert torch.equal(page(r, p, dst), original[i][j]), (i, src, dst)
            assert torch.equal(page(r, p, src), clobbered[i][j]), (i, src)
        assert torch.equal(page(r, p, untouched), sentinel[i][0]), i
    connector.shutdown()
