"""Property test of KVCacheManager: random arrivals with shared prefixes, chunked prefill,
decode, preemption and frees, on unitary and hybrid configs. After every step: no page is held
twice or by two groups, reference counts match the block tables, the free count is the rest;
every prefix hit returns pages holding exactly the request's prefix; at the end nothing leaks."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

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
from tests.v1.core.test_hybrid_model_managers import scheduler_config
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


@dataclass(frozen=True)
class Case:
    """A manager config: ``groups(num_blocks)`` builds it with a pool of that size; token
    counts of the random schedule (documents, tails, chunks, connector tokens) are multiplied
    by ``scale`` so requests span a similar number of pages whatever the block size."""

    groups: Callable[[int], KVCacheConfig]
    hash_block_size: int
    chunk: int
    scale: int = 1
    pool_sizes: tuple[int, ...] = (12, 20, 40)
    caching: bool = True
    eagle: bool = False


def hand_built(*specs: KVCacheSpec) -> Callable[[int], KVCacheConfig]:
    return lambda num_blocks: config_of(num_blocks, *specs)


@functools.cache
def planned(model: str, num_blocks: int) -> KVCacheConfig:
    """The scheduler's config the planner makes for ``model``; 16-token pages."""
    return scheduler_config(model, (MAX_REQUEST_TOKENS + 8) * PLANNER_SCALE, 64, num_blocks)


PLANNER_SCALE = 4
CASES: dict[str, Case] = {
    "full": Case(hand_built(full(4)), 4, 6),
    "full+sliding": Case(hand_built(full(4), sliding(4, 6)), 4, 5),
    "full+sliding(block 8)": Case(hand_built(full(4), sliding(8, 10)), 4, 7),
    "full+2sliding+mamba": Case(
        hand_built(full(4), sliding(4, 5), sliding(4, 5), mamba(4, "all")), 4, 6
    ),
    "full+mamba(align)": Case(hand_built(full(4), mamba(4, "align")), 4, 8),
    "full+chunked local": Case(hand_built(full(4), chunked(4, 8)), 4, 6),
    # EAGLE: every group looks one page further and drops it (Mamba keeps its state page).
    "full+mamba (eagle)": Case(hand_built(full(4), mamba(4, "all")), 4, 6, eagle=True),
    "full+sliding (eagle)": Case(hand_built(full(4), sliding(4, 6)), 4, 5, eagle=True),
    "no prefix cache": Case(hand_built(full(4), sliding(4, 6)), 4, 5, caching=False),
    # The planner's groups for real hybrid models: sliding window 128 + full attention, and
    # four sliding-window groups beside a full one.
    "gpt-oss-20b (planner)": Case(
        functools.partial(planned, "gpt-oss-20b"), 16, 24, PLANNER_SCALE, (30, 48, 80)
    ),
    "gemma-3-27b-it (planner)": Case(
        functools.partial(planned, "gemma-3-27b-it"), 16, 24, PLANNER_SCALE, (64, 96, 150)
    ),
}
MAX_REQUEST_TOKENS = 40
# Three documents that prompts start from, so requests share prefixes.
DOCUMENTS = [[random.Random(d).randrange(8) for _ in range(24)] for d in range(3)]

# Tokens a connector supplies after a new request's prefix hit (mostly none).
EXTERNAL_TOKENS = (0, 0, 0, 1, 3, 4, 9, 16)
POOLS = range(3)  # which of a case's pool sizes
LONG_SEEDS, LONG_STEPS = 60, 300
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("new"),
            st.integers(0, len(DOCUMENTS) - 1),
            st.integers(0, 24),
            st.lists(st.integers(0, 7), min_size=1, max_size=8),
            st.sampled_from(EXTERNAL_TOKENS),
        ),
        st.tuples(st.sampled_from(["preempt", "finish"]), st.integers(0, 7)),
        # a step of one request, with 0-3 speculative lookahead slots
        st.tuples(st.just("step"), st.integers(0, 7), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=40,
)


def make_sim(name: str, num_blocks: int) -> ManagerSim:
    case = CASES[name]
    manager = KVCacheManager(
        case.groups(num_blocks),
        max_model_len=(MAX_REQUEST_TOKENS + 8) * case.scale,
        hash_block_size=case.hash_block_size,
        enable_caching=case.caching,
        use_eagle=case.eagle,
    )
    return ManagerSim(manager, case.chunk)


def scaled(tokens: list[int], scale: int) -> list[int]:
    """Each token repeated ``scale`` times with a distinct id, so shared prefixes stay shared
    at the same page boundaries."""
    return [t * scale + i for t in tokens for i in range(scale)]


def run_schedule(name: str, ops: list[tuple], pool: int) -> None:
    """Drive a manager through ``ops``, checking the invariants after every step and for
    leaks at the end. Small pools make requests wait and evict cached pages; large ones keep
    more hits. Connector tokens make groups take fresh pages while other groups still have to
    claim their hits (which must not be evicted for them), and every refused allocation must
    leave the pool as it was."""
    case = CASES[name]
    sim = make_sim(name, case.pool_sizes[pool])
    manager = sim.manager
    requests = []  # every request that arrived and has not finished, in arrival order
    for step, op in enumerate(ops):
        manager.new_step_starts()
        if op[0] == "new":
            _, doc, prefix_len, tail, external = op
            tokens = scaled(DOCUMENTS[doc][:prefix_len] + tail, case.scale)
            requests.append(make_request(f"r{step}", tokens, case.hash_block_size))
            sim.schedule(requests[-1], external=external * case.scale)
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
            if request.num_tokens >= MAX_REQUEST_TOKENS * case.scale and request in requests:
                sim.finish(request)
                requests.remove(request)
        sim.check_invariants()
    sim.free_all_and_check_no_leak()
    if not case.caching:
        assert sim.num_hit_tokens == 0


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, pool=st.integers(0, len(POOLS) - 1))
def test_random_schedules_keep_the_pool_consistent(name: str, ops: list[tuple], pool: int) -> None:
    run_schedule(name, ops, pool)


def random_ops(rng: random.Random, num_ops: int) -> list[tuple]:
    """``num_ops`` operations drawn like :data:`OPS` draws them."""
    ops: list[tuple] = []
    for _ in range(num_ops):
        kind = rng.random()
        if kind < 0.35:
            tail = [rng.randrange(8) for _ in range(rng.randint(1, 8))]
            external = rng.choice(EXTERNAL_TOKENS)
            ops.append(("new", rng.randrange(len(DOCUMENTS)), rng.randint(0, 24), tail, external))
        elif kind < 0.5:
            ops.append((rng.choice(["preempt", "finish"]), rng.randrange(8)))
        else:
            ops.append(("step", rng.randrange(8), rng.randint(0, 3)))
    return ops


@pytest.mark.parametrize("name", list(CASES))
def test_long_random_schedules_keep_the_pool_consistent(name: str) -> None:
    """Long seeded schedules: the faults that need many requests' pages interleaved in the
    free queue (a group's connector pages evicting another group's prefix hit) show up within
    a few hundred steps, which hypothesis' short examples rarely reach."""
    for seed in range(LONG_SEEDS):
        rng = random.Random(seed)
        run_schedule(name, random_ops(rng, LONG_STEPS), rng.randrange(len(POOLS)))


def test_shared_prefixes_do_hit() -> None:
    """The property test above cannot fail by never hitting: a fixed schedule of two requests
    on one document hits on every prefix-caching config (hybrid hits are whole LCM blocks)."""
    for name, case in CASES.items():
        hash_block_size, chunk, caching = case.hash_block_size, case.chunk, case.caching
        sim = make_sim(name, case.pool_sizes[-1])
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
