"""Property test of KVCacheManager: random arrivals with shared prefixes, chunked prefill,
decode, preemption and frees, on unitary and hybrid configs. After every step: no page is held
twice or by two groups, reference counts match the block tables, the free count is the rest;
every prefix hit returns pages holding exactly the request's prefix; at the end nothing leaks."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.v1.core.block_manager_test_utils import (
    ManagerSim,
    chunked,
    config_of,
    full,
    make_request,
    mamba,
    sliding,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import KVCacheSpec

# name -> (specs, hash block size, chunk tokens, prefix caching)
CONFIGS: dict[str, tuple[tuple[KVCacheSpec, ...], int, int, bool]] = {
    "full": ((full(4),), 4, 6, True),
    "full+sliding": ((full(4), sliding(4, 6)), 4, 5, True),
    "full+sliding(block 8)": ((full(4), sliding(8, 10)), 4, 7, True),
    "full+2sliding+mamba": ((full(4), sliding(4, 5), sliding(4, 5), mamba(4, "all")), 4, 6, True),
    "full+mamba(align)": ((full(4), mamba(4, "align")), 4, 8, True),
    "full+chunked local": ((full(4), chunked(4, 8)), 4, 6, True),
    "no prefix cache": ((full(4), sliding(4, 6)), 4, 5, False),
}
NUM_BLOCKS = 40
MAX_REQUEST_TOKENS = 40
# Three documents that prompts start from, so requests share prefixes.
DOCUMENTS = [[random.Random(d).randrange(8) for _ in range(24)] for d in range(3)]

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("new"),
            st.integers(0, len(DOCUMENTS) - 1),
            st.integers(0, 24),
            st.lists(st.integers(0, 7), min_size=1, max_size=8),
        ),
        st.tuples(st.sampled_from(["preempt", "finish"]), st.integers(0, 7)),
        # a step of one request, with 0-3 speculative lookahead slots
        st.tuples(st.just("step"), st.integers(0, 7), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=40,
)


def make_sim(name: str, num_blocks: int) -> ManagerSim:
    specs, hash_block_size, chunk, caching = CONFIGS[name]
    manager = KVCacheManager(
        config_of(num_blocks, *specs),
        max_model_len=MAX_REQUEST_TOKENS + 8,
        hash_block_size=hash_block_size,
        enable_caching=caching,
    )
    return ManagerSim(manager, chunk)


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.sampled_from([12, 20, NUM_BLOCKS]))
def test_random_schedules_keep_the_pool_consistent(
    name: str, ops: list[tuple], num_blocks: int
) -> None:
    """Small pools make requests wait and evict cached pages; large ones keep more hits."""
    sim = make_sim(name, num_blocks)
    manager = sim.manager
    requests = []  # every request that arrived and has not finished, in arrival order
    for step, op in enumerate(ops):
        manager.new_step_starts()
        if op[0] == "new":
            _, doc, prefix_len, tail = op
            requests.append(make_request(f"r{step}", DOCUMENTS[doc][:prefix_len] + tail, 4))
            sim.schedule(requests[-1])
        elif requests:
            request = requests[op[1] % len(requests)]
            running = request.request_id in sim.running
            if op[0] == "step":
                sim.schedule(request, next_token=step % 8, lookahead=op[2])
            elif op[0] == "preempt" and running:
                sim.preempt(request)
            elif op[0] == "finish":
                sim.finish(request)
                requests.remove(request)
            if request.num_tokens >= MAX_REQUEST_TOKENS and request in requests:
                sim.finish(request)
                requests.remove(request)
        sim.check_invariants()
    sim.free_all_and_check_no_leak()
    if not CONFIGS[name][3]:
        assert sim.num_hit_tokens == 0


def test_shared_prefixes_do_hit() -> None:
    """The property test above cannot fail by never hitting: a fixed schedule of two requests
    on one document hits on every prefix-caching config (hybrid hits are whole LCM blocks)."""
    for name, (_, hash_block_size, chunk, caching) in CONFIGS.items():
        sim = make_sim(name, NUM_BLOCKS)
        manager = sim.manager
        first = make_request("a", DOCUMENTS[0] + [1], hash_block_size)
        for _ in range(cdiv(first.num_tokens, chunk)):
            assert sim.schedule(first)
        manager.new_step_starts()
        second = make_request("b", DOCUMENTS[0] + [2], hash_block_size)
        assert sim.schedule(second)
        assert (sim.num_hit_tokens > 0) == caching, name
        sim.check_invariants()
        sim.free_all_and_check_no_leak()
