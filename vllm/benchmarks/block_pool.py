"""Benchmark of the block pool: allocate, cache, prefix lookup and free, in µs per block, at
100k+ pages and 1k concurrent requests; beside upstream vLLM's own implementation when its
unpacked sdist is given (``--upstream PATH``, loaded by :mod:`vllm.benchmarks.upstream_block_pool`).

One *round* runs the scheduler's block traffic on a fresh pool of ``--num-blocks`` pages
(prefix caching on, events off) for ``--requests`` requests of ``--blocks-per-request`` full
blocks each, all resident at once, and times each phase over every request:

- ``allocate``: ``get_new_blocks(n)`` per request from a pool with no cached blocks;
- ``cache``: ``cache_full_blocks`` of each request's blocks under its block hashes;
- ``free``: ``free_blocks`` of each request's blocks, tail first (they stay cached);
- ``lookup``: a second request with the same prompt: ``get_cached_block`` per block hash, then
  ``touch`` of the hits (takes them back out of the free queue); then freed again, untimed;
- ``evict``: ``get_new_blocks(n)`` per request from a pool whose free blocks are all cached,
  so every block handed out is evicted from the prefix cache first;
- ``hash``: the request block hasher (``get_request_block_hasher``, sha256) over each prompt.

``allocate+free+lookup`` is the sum of those three per block. Times are per block (phase time /
blocks in the phase). Rounds alternate the implementations (ours, upstream, ours, ...) so both
see the same machine state; a row reports the minimum over ``--rounds`` rounds (the least
disturbed) and the median, with the spread and flags of :mod:`vllm.benchmarks.noise` (``noisy``:
rounds spread over the limit; ``contended``: this process waited for a CPU). Upstream is loaded
in this process; when it cannot be, the run says why and reports this library alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.benchmarks import noise
from vllm.benchmarks.upstream_block_pool import load_upstream
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import block_pool, kv_cache_utils
from vllm.v1.request import Request

PHASES = ("allocate", "cache", "free", "lookup", "evict", "hash")
TOTAL = "allocate+free+lookup"
FULL = {"num_blocks": 131_072, "requests": 1024, "blocks_per_request": 100, "rounds": 5}
QUICK = {"num_blocks": 8192, "requests": 64, "blocks_per_request": 64, "rounds": 3}
BLOCK_SIZE = 16  # tokens per block


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation: its ``BlockPool`` class and its module of hashing functions."""

    name: str
    pool_cls: Any
    hashing: Any


@dataclasses.dataclass(kw_only=True)
class BlockPoolRow(noise.RepeatStats):
    """One (implementation, phase): µs per block over the rounds."""

    impl: str
    phase: str
    us_per_block_min: float
    us_per_block_median: float
    x_upstream: float | None = None
    """Upstream's minimum / ours (> 1: ours is faster); on our rows when upstream ran."""


def _requests(
    n: int, blocks: int, salt: str, hasher: Callable[[Request], list[bytes]] | None
) -> list[Request]:
    """``n`` requests of ``blocks`` full blocks each with distinct prompts (``salt`` tells two
    sets apart); hashed by ``hasher`` when given."""
    params = SamplingParams(max_tokens=1)
    return [
        Request(
            request_id=f"{salt}{i}",
            prompt_token_ids=[i * 1_000_003 + t for t in range(blocks * BLOCK_SIZE)],
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        for i in range(n)
    ]


def _timed(fn: Callable[[], None]) -> float:
    gc.collect()  # no collection of the previous phase's garbage inside this one
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_round(impl: Impl, num_blocks: int, requests: list[Request], twins: list[Request]) -> dict:
    """Seconds per block of each phase for one round (see the module doc)."""
    per_req = len(requests[0].block_hashes)
    n_blocks = len(requests) * per_req
    pool = impl.pool_cls(num_blocks, True, BLOCK_SIZE)
    held: list[list[Any]] = []
    seconds: dict[str, float] = {}

    def allocate() -> None:
        held[:] = [pool.get_new_blocks(per_req) for _ in requests]

    def cache() -> None:
        for req, blocks in zip(requests, held, strict=True):
            pool.cache_full_blocks(req, blocks, 0, per_req, BLOCK_SIZE, 0)

    def free() -> None:
        for blocks in held:
            pool.free_blocks(reversed(blocks))

    def lookup() -> None:
        get = pool.get_cached_block
        for req in twins:
            hits = []
            for h in req.block_hashes:
                found = get(h, [0])
                if found is None:
                    break
                hits.append(found[0])
            pool.touch(hits)
            held.append(hits)

    seconds["allocate"] = _timed(allocate)
    seconds["cache"] = _timed(cache)
    seconds["free"] = _timed(free)
    held.clear()
    seconds["lookup"] = _timed(lookup)
    if sum(len(h) for h in held) != n_blocks:
        raise RuntimeError(f"{impl.name}: the lookup phase missed cached blocks")
    free()
    held.clear()
    seconds["evict"] = _timed(allocate)
    hasher = impl.hashing.get_request_block_hasher(BLOCK_SIZE, sha256)

    def hash_all() -> None:
        for req in requests:
            req.block_hashes = []
            req.block_hashes.extend(hasher(req))

    seconds["hash"] = _timed(hash_all)
    return {phase: s / n_blocks for phase, s in seconds.items()}


def run(
    num_blocks: int,
    requests: int,
    blocks_per_request: int,
    rounds: int,
    upstream: str | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> tuple[list[BlockPoolRow], dict[str, Any]]:
    """The rows, and what the run knows about itself (sizes, upstream's load)."""
    if requests * blocks_per_request >= num_blocks:
        raise ValueError(
            f"num_blocks: expected more than requests x blocks_per_request = "
            f"{requests * blocks_per_request} pages (the null block takes one), got {num_blocks}"
        )
    impls = [Impl("ours", block_pool.BlockPool, kv_cache_utils)]
    info: dict[str, Any] = {"upstream": None, "upstream_error": None, "stand_ins": []}
    if upstream is not None:
        try:
            loaded = load_upstream(upstream)
        except ImportError as e:
            info["upstream_error"] = str(e)
            log(f"upstream not run: {e}")
        else:
            impls.append(Impl("upstream", loaded.block_pool.BlockPool, loaded.kv_cache_utils))
            info.update(upstream=upstream, stand_ins=loaded.stand_ins)
    kv_cache_utils.init_none_hash(sha256)
    for impl in impls:
        # One chain seed for all: equal hashes for equal prompts, checked every round.
        impl.hashing.NONE_HASH = kv_cache_utils.NONE_HASH
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, sha256)
    reqs = _requests(requests, blocks_per_request, "a", hasher)
    twins = _requests(requests, blocks_per_request, "b", hasher)
    samples: dict[tuple[str, str], list[float]] = {}
    watch = noise.MachineWatch()
    machines = []
    for r in range(rounds):
        watch.start_row()
        for impl in impls:
            for phase, s in run_round(impl, num_blocks, reqs, twins).items():
                samples.setdefault((impl.name, phase), []).append(s)
            if reqs[-1].block_hashes != twins[-1].block_hashes:
                raise RuntimeError(f"{impl.name}: block hashes differ from this library's")
        machines.append(watch.end_row())
        log(f"round {r + 1}/{rounds} done")
    for impl in impls:
        sums = zip(*(samples[(impl.name, p)] for p in ("allocate", "free", "lookup")), strict=True)
        samples[(impl.name, TOTAL)] = [sum(t) for t in sums]
    rows = [_row(impl.name, phase, samples[(impl.name, phase)], machines)
            for impl in impls for phase in (*PHASES, TOTAL)]  # fmt: skip
    if len(impls) == 2:
        theirs = {r.phase: r.us_per_block_min for r in rows if r.impl == "upstream"}
        for row in rows:
            if row.impl == "ours":
                row.x_upstream = theirs[row.phase] / row.us_per_block_min
    info["load"] = watch.finish().to_json()
    return rows, info


def _row(impl: str, phase: str, seconds: Sequence[float], machines: Sequence[Any]) -> BlockPoolRow:
    waits = [m.cpu_wait_pct for m in machines if m.cpu_wait_pct is not None]
    row = BlockPoolRow(
        impl=impl,
        phase=phase,
        us_per_block_min=min(seconds) * 1e6,
        us_per_block_median=statistics.median(seconds) * 1e6,
        repeats=len(seconds),
        op_us_samples=[s * 1e6 for s in seconds],
        op_spread_pct=noise.spread_pct(seconds),
        load_avg=[machines[0].load_avg[0], machines[-1].load_avg[-1]],
        cpu_wait_pct=max(waits) if waits else None,
    )
    row.flags = noise.flags_for(row, pct_roofline=0.0, mode="warm")
    return row


def table(rows: Sequence[BlockPoolRow]) -> str:
    """The rows as a terminal table."""
    headers = ["impl", "phase", "min µs/block", "median", "spread %", "x upstream", "flags"]
    body = [
        [
            r.impl,
            r.phase,
            f"{r.us_per_block_min:.3f}",
            f"{r.us_per_block_median:.3f}",
            f"{r.op_spread_pct:.0f}",
            "" if r.x_upstream is None else f"{r.x_upstream:.2f}",
            ",".join(r.flags),
        ]
        for r in rows
    ]
    return noise.fixed_width(headers, body, left={0, 1, 6})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    parser.add_argument("--num-blocks", type=int, help=f"pages (default {FULL['num_blocks']})")
    parser.add_argument("--requests", type=int, help=f"(default {FULL['requests']})")
    parser.add_argument(
        "--blocks-per-request", type=int, help=f"(default {FULL['blocks_per_request']})"
    )
    parser.add_argument("--rounds", type=int, help=f"(default {FULL['rounds']})")
    parser.add_argument("--upstream", metavar="PATH", help="unpacked upstream vLLM sdist")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    for key in sizes:
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                parser.error(f"--{key.replace('_', '-')}: expected a positive int, got {value}")
            sizes[key] = value
    rows, info = run(**sizes, upstream=args.upstream)
    print(table(rows))
    print("\n".join(noise.legend(rows)))
    if info["upstream_error"]:
        print(f"upstream: not run ({info['upstream_error']})")
    elif info["upstream"]:
        print(f"upstream: {info['upstream']} (stand-ins: {', '.join(info['stand_ins'])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"sizes": sizes, **info, "rows": [noise.row_json(r) for r in rows]}, f, indent=2
            )
    return 0
