"""Mooncake-tier faults are misses or clear errors in bounded time, never corruption: after each
fault the reader's whole cache is byte-identical to before (poisoned-cache check). Loads go as
an engine's do: a lookup promotes a block from the tier into the CPU primary tier, and only a
load whose every block was promoted copies into the GPU cache."""

from __future__ import annotations

import time

import pytest
from mooncake_harness import CacheHandle, MooncakeMaster, block_hashes

pytestmark = pytest.mark.needs_mooncake

MB = 1 << 20
BOUND_S = 15.0
"""Longest a failed operation may take (a killed master fails calls in about 5 s)."""


@pytest.fixture
def pair(request, shared_instances) -> tuple[CacheHandle, CacheHandle]:
    """The module's two instances, acting on caches named after the test (for tests that
    leave the module's master running)."""
    writer, reader = shared_instances
    return CacheHandle(writer, request.node.name), CacheHandle(reader, request.node.name)


@pytest.fixture
def solo_pair(spawn) -> tuple[CacheHandle, CacheHandle]:
    """Two caches (two store clients) of one fresh instance, for tests that fill the store
    or kill its master (the module's instances stay clean)."""
    solo = spawn("solo")
    return CacheHandle(solo, "writer"), CacheHandle(solo, "reader")


def start_pair(master, pair, fmt="bf16", num_blocks=16):
    """Register the caches of both :class:`CacheHandle` of ``pair`` with ``master``; the
    reader's pages get known bytes."""
    writer, reader = pair
    for instance in (writer, reader):
        instance.call(
            "init_store",
            fmt=fmt,
            num_blocks=num_blocks,
            master=master.address,
            segment_size=16 * MB,
        )
    reader.call("fill", seed=99, blocks=list(range(num_blocks)))
    return writer, reader


def assert_miss_untouched(reader, hashes, blocks, before, expect) -> None:
    """Loading ``hashes`` fails within the bound with ``expect`` in its error (a "miss": a
    block in no tier, or a :class:`StoreMiss` of its promotion; case-insensitive), and the
    reader's whole cache still hashes to ``before``."""
    start = time.monotonic()
    result = reader.call("load", hashes=hashes, blocks=blocks)
    assert time.monotonic() - start < BOUND_S
    assert not result["success"], result
    assert expect.lower() in result["error"].lower(), result
    assert reader.call("digest_all") == before


def test_missing_keys_are_a_miss(shared_master, pair) -> None:
    writer, reader = start_pair(shared_master, pair)
    hashes = block_hashes("stored", 3)
    writer.call("fill", seed=1, blocks=[0, 1, 2])
    assert writer.call("offload", hashes=hashes, blocks=[0, 1, 2])["success"]
    before = reader.call("digest_all")
    # One block of the batch was never stored: nothing of the batch is written.
    wanted = hashes[:2] + block_hashes("never-stored", 1)
    assert reader.call("lookup", hashes=wanted)["count"] == 2
    assert_miss_untouched(reader, wanted, [5, 6, 7], before, "miss")


def test_eviction_when_segments_are_full(master, solo_pair) -> None:
    # 6 MiB blocks; two 16 MiB segments hold at most 4 of them, 12 are offloaded.
    writer, reader = start_pair(master, solo_pair, fmt="large", num_blocks=4)
    hashes = block_hashes("long-prompt", 12)
    expected = writer.call("fill", seed=3, blocks=[0, 1, 2, 3])
    outcomes = [
        writer.call("offload", hashes=hashes[i : i + 4], blocks=[0, 1, 2, 3])
        for i in range(0, 12, 4)
    ]
    assert any(o["success"] for o in outcomes)
    present = [reader.call("lookup", hashes=[h])["count"] for h in hashes]
    assert 0 < sum(present) < 12, present
    before = reader.call("digest_all")
    # A block that is gone (evicted, or never stored because the store was full) is a miss.
    gone = [h for h, p in zip(hashes, present, strict=True) if not p]
    assert_miss_untouched(reader, gone[:2], [0, 1], before, "miss")
    # What is still present loads byte-exact.
    i = present.index(1)
    result = reader.call("load", hashes=[hashes[i]], blocks=[2])
    assert result["success"], result
    assert reader.call("digest", blocks=[2]) == [expected[i % 4]]


def test_object_larger_than_every_segment_is_a_clear_error(shared_master, pair) -> None:
    # 18 MiB blocks, 16 MiB segments: the put fails, nothing is stored.
    writer, reader = start_pair(shared_master, pair, fmt="huge", num_blocks=2)
    hashes = block_hashes("big", 2)
    writer.call("fill", seed=4, blocks=[0, 1])
    start = time.monotonic()
    result = writer.call("offload", hashes=hashes, blocks=[0, 1])
    assert time.monotonic() - start < BOUND_S
    assert not result["success"]
    assert "MooncakeStoreError" in result["error"] and "put failed" in result["error"]
    assert reader.call("lookup", hashes=hashes)["count"] == 0
    before = reader.call("digest_all")
    assert_miss_untouched(reader, hashes, [1, 0], before, "miss")


def test_killed_writer(sandbox, tmp_path, spawn) -> None:
    # A master that drops a silent client's segment after 3 s instead of the default 10 s.
    master = MooncakeMaster(sandbox, tmp_path, ["--client_ttl=3"])
    try:
        check_killed_writer(master, spawn)
    finally:
        master.stop()


def check_killed_writer(master, spawn) -> None:
    pair = (CacheHandle(spawn("writer"), "c"), CacheHandle(spawn("reader"), "c"))
    writer, reader = start_pair(master, pair)
    hashes = block_hashes("dying-writer", 4)
    expected = writer.call("fill", seed=5, blocks=[0, 1, 2, 3])
    assert writer.call("offload", hashes=hashes, blocks=[0, 1, 2, 3])["success"]
    writer.kill()
    targets = [8, 9, 10, 11]
    others = [b for b in range(16) if b not in targets]  # start_pair's 16 blocks
    before = reader.call("digest", blocks=others)
    start = time.monotonic()
    result = reader.call("load", hashes=hashes, blocks=targets)
    assert time.monotonic() - start < BOUND_S
    if result["success"]:  # the objects happened to live in the reader's own segment
        assert reader.call("digest", blocks=targets) == expected
    else:
        # Blocks that vanish with their holder fail the job, whose own pages may then be
        # partly written; no other page is touched.
        assert "StoreMiss" in result["error"] or "MooncakeStoreError" in result["error"], result
    assert reader.call("digest", blocks=others) == before
    # Once the master has dropped the dead client's segment, its blocks are misses.
    deadline = time.monotonic() + 30
    while reader.call("lookup", hashes=hashes)["count"] == 4:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if reader.call("lookup", hashes=hashes)["count"] < 4:
        # A fresh reader cache (its primary tier has not promoted them) loads nothing.
        fresh = CacheHandle(reader.instance, "c-after")
        fresh.call(
            "init_store", fmt="bf16", num_blocks=16, master=master.address, segment_size=16 * MB
        )
        fresh.call("fill", seed=98, blocks=list(range(16)))
        before = fresh.call("digest_all")
        start = time.monotonic()
        result = fresh.call("load", hashes=hashes, blocks=[12, 13, 14, 15])
        assert time.monotonic() - start < BOUND_S
        assert not result["success"], result
        assert "miss" in result["error"].lower() or "MooncakeStoreError" in result["error"]
        assert fresh.call("digest_all") == before


def test_killed_master(master, solo_pair) -> None:
    writer, reader = start_pair(master, solo_pair)
    hashes = block_hashes("master-dies", 3)
    writer.call("fill", seed=6, blocks=[0, 1, 2])
    assert writer.call("offload", hashes=hashes, blocks=[0, 1, 2])["success"]
    before = reader.call("digest_all")
    master.kill()
    start = time.monotonic()
    assert reader.call("lookup", hashes=hashes)["count"] == 0
    assert time.monotonic() - start < BOUND_S
    start = time.monotonic()
    result = reader.call("load", hashes=hashes, blocks=[4, 5, 6])
    assert time.monotonic() - start < BOUND_S
    assert not result["success"]
    assert reader.call("digest_all") == before
    start = time.monotonic()
    fresh = block_hashes("after-the-master", 3)
    assert not writer.call("offload", hashes=fresh, blocks=[0, 1, 2])["success"]
    assert time.monotonic() - start < BOUND_S


@pytest.mark.parametrize("part", ["header", "data"])
def test_foreign_or_corrupt_object_writes_nothing(shared_master, pair, part: str) -> None:
    master = shared_master
    writer, reader = start_pair(master, pair)
    hashes = block_hashes(f"foreign-{part}", 2)
    writer.call("fill", seed=7, blocks=[0, 1])
    assert writer.call("offload", hashes=hashes, blocks=[0, 1])["success"]
    if part == "header":
        # The header of another format (same key: what a buggy or foreign writer leaves).
        writer.call(
            "init_store",
            cache=writer.cache + "-nvfp4",
            fmt="nvfp4",
            num_blocks=4,
            master=master.address,
            segment_size=16 * MB,
        )
        payload = writer.call("header_of", cache=writer.cache + "-nvfp4")
        expect = "header of block"
    else:
        payload = "ab" * 1000  # an object 1000 bytes long instead of a header and 16 KiB
        expect = "bytes (header and block), got 1000 bytes"
    assert writer.call("replace_object", hash_hex=hashes[1], part=part, data_hex=payload) == 0
    before = reader.call("digest_all")
    assert_miss_untouched(reader, hashes, [6, 7], before, expect)


def test_unreachable_master_is_a_clear_error(sandbox, pair) -> None:
    reader = pair[1]
    start = time.monotonic()
    with pytest.raises(Exception, match="no mooncake_master answers at 127.0.0.1:"):
        reader.call(
            "init_store",
            fmt="bf16",
            num_blocks=4,
            master=f"127.0.0.1:{sandbox.free_port()}",
            segment_size=16 * MB,
        )
    assert time.monotonic() - start < BOUND_S
