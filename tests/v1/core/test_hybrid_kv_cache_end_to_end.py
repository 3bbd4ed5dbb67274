"""Plan -> manager -> block ids -> caches, end to end for gpt-oss-20b (sliding window + full
attention; the planner makes each tensor shared by one sliding and one full layer, so both groups'
block ids index the same buffers).

Requests run through the KVCacheManager; each computed chunk is written into every layer's cache
by the C++ writer ``torch.ops._C_cache_ops.reshape_and_cache_flash`` at the slots the request's
block ids imply (``block_id * block_size + position % block_size``). Reading every live page back
must give the K/V of the request's own tokens: prefix-hit pages hold the first request's data,
and no page of one group or request was overwritten by another."""

from __future__ import annotations

import random

import torch

import vllm._custom_ops  # noqa: F401  (loads the extension that registers the C++ writer)
from tests.v1.core.block_manager_test_utils import ManagerSim, make_request
from vllm.v1.attention.backends.reference import ReferenceAttentionBackend
from vllm.v1.attention.backends.utils import split_kv_cache
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig
from vllm.v1.request import Request
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

MODEL = "gpt-oss-20b"
MAX_MODEL_LEN = 256
STEP = 64  # tokens per step (chunked prefill)
NUM_BLOCKS = 48
VOCAB = 32


class CacheWritingSim(ManagerSim):
    """A ManagerSim whose "forward pass" writes each layer's K/V into the real caches."""

    def __init__(
        self,
        manager: KVCacheManager,
        config: KVCacheConfig,
        caches: dict[str, torch.Tensor],
    ) -> None:
        super().__init__(manager, STEP)
        self.config = config
        self.caches = {name: split_kv_cache(cache) for name, cache in caches.items()}
        gen = torch.Generator().manual_seed(0)
        # K/V of token t at position p in layer l: token[l][t] + position[l][p] (bf16), so
        # equal tokens at equal positions give equal bytes and anything else differs.
        spec = config.kv_cache_groups[0].kv_cache_spec
        assert isinstance(spec, AttentionSpec)
        shape = (spec.num_kv_heads, spec.head_size)
        self.token_kv = {name: torch.randn(2, VOCAB, *shape, generator=gen) for name in self.caches}
        self.position_kv = {
            name: torch.randn(2, MAX_MODEL_LEN, *shape, generator=gen) for name in self.caches
        }
        self.dtype = spec.dtype

    def kv(self, layer: str, tokens: list[int], start: int, end: int) -> torch.Tensor:
        """``[2, end - start, H, D]`` K and V of positions ``[start, end)``."""
        ids = torch.tensor(tokens[start:end])
        kv = self.token_kv[layer][:, ids] + self.position_kv[layer][:, start:end]
        return kv.to(self.dtype)

    def _compute(self, request: Request, start: int, end: int) -> None:
        super()._compute(request, start, end)
        tokens = list(request.all_token_ids)
        one = torch.ones(1)
        for group, block_ids in zip(
            self.config.kv_cache_groups,
            self.manager.get_block_ids(request.request_id),
            strict=True,
        ):
            block_size = group.kv_cache_spec.block_size
            positions = range(start, end)
            slots = torch.tensor(
                [block_ids[p // block_size] * block_size + p % block_size for p in positions]
            )
            for layer in group.layer_names:
                k, v = self.kv(layer, tokens, start, end)
                key_cache, value_cache = self.caches[layer]
                torch.ops._C_cache_ops.reshape_and_cache_flash(
                    k, v, key_cache, value_cache, slots, "auto", one, one
                )

    def check_pages(self, request: Request) -> int:
        """Read every live page of the request back; returns the tokens checked per layer."""
        tokens = list(request.all_token_ids)
        checked = 0
        for group, block_ids in zip(
            self.config.kv_cache_groups,
            self.manager.get_block_ids(request.request_id),
            strict=True,
        ):
            block_size = group.kv_cache_spec.block_size
            null_id = self.manager.block_pool.null_block.block_id
            live = [
                p
                for p in range(request.num_computed_tokens)
                if block_ids[p // block_size] != null_id
            ]
            index = torch.tensor([block_ids[p // block_size] for p in live])
            offset = torch.tensor([p % block_size for p in live])
            for layer in group.layer_names:
                key_cache, value_cache = self.caches[layer]
                expected = torch.stack(
                    [self.kv(layer, tokens, p, p + 1)[:, 0] for p in live], dim=1
                )
                got = torch.stack([key_cache[index, offset], value_cache[index, offset]])
                assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), layer
            checked += len(live)
        return checked


def test_plan_manager_block_ids_caches_round_trip() -> None:
    probe = kcu.plan_kv_cache(MODEL, None, 1 << 40, MAX_MODEL_LEN, max_num_batched_tokens=STEP)
    plan = kcu.plan_kv_cache(
        MODEL, None, NUM_BLOCKS * probe.bytes_per_block, MAX_MODEL_LEN, max_num_batched_tokens=STEP
    )
    config = plan.kv_cache_config
    assert config.num_blocks == NUM_BLOCKS
    # Both groups share every tensor: block ids of the two groups index the same bytes.
    assert all(len(t.shared_by) == 2 for t in config.kv_cache_tensors)
    caches = init_layer_kv_caches(
        config, [ReferenceAttentionBackend] * 2, "cpu", model_dtype=torch.bfloat16
    )
    assert all(cache.shape[0] == NUM_BLOCKS for cache in caches.values())
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    manager = KVCacheManager(
        kcu.generate_scheduler_kv_cache_config([config]),
        max_model_len=MAX_MODEL_LEN,
        hash_block_size=block_size,
        max_num_batched_tokens=STEP,
    )
    sim = CacheWritingSim(manager, config, caches)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(200)]
    first = make_request("first", prompt, block_size)
    for step in range(4):  # 200 prompt tokens in chunks of 64
        assert sim.schedule(first, next_token=step)
    assert sim.schedule(first, next_token=7)  # one decode token
    sim.check_invariants()
    assert sim.check_pages(first) > 0

    second = make_request("second", prompt[:150] + [1, 2, 3], block_size)
    assert sim.schedule(second)
    assert sim.last_hit is not None and sim.last_hit[1] == 150 // block_size * block_size
    sim.check_invariants()
    # The hit pages (written by the first request), the second request's own pages, and the
    # first request's pages after the second one wrote: all hold their own tokens.
    assert sim.check_pages(second) > 0
    assert sim.check_pages(first) > 0
    sim.free_all_and_check_no_leak()
