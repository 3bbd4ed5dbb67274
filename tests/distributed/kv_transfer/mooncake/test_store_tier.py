"""The Mooncake store tier: two instances (processes) share offloaded pages through a real
``mooncake_master``, byte-exact for every format, into differently numbered pages."""

from __future__ import annotations

import pytest
from mooncake_harness import FORMATS, assert_loopback_only, block_hashes

pytestmark = pytest.mark.needs_mooncake

SEGMENT = 16 << 20


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_instances_share_pages_byte_exact(shared_master, shared_instances, fmt: str) -> None:
    writer, reader = shared_instances
    address = shared_master.address
    fp_w = writer.call(
        "init_store", cache=fmt, fmt=fmt, num_blocks=12, master=address, segment_size=SEGMENT
    )
    fp_r = reader.call(
        "init_store", cache=fmt, fmt=fmt, num_blocks=10, master=address, segment_size=SEGMENT
    )
    assert fp_w["fingerprint"] == fp_r["fingerprint"]
    assert fp_w["pid"] != fp_r["pid"]
    hashes = block_hashes(f"prompt-{fmt}", 5)
    src_blocks = [7, 2, 9, 0, 11]
    expected = writer.call("fill", cache=fmt, seed=1, blocks=src_blocks)
    assert reader.call("lookup", cache=fmt, hashes=hashes)["count"] == 0

    result = writer.call("offload", cache=fmt, hashes=hashes, blocks=src_blocks)
    assert result["success"], result
    assert reader.call("lookup", cache=fmt, hashes=hashes)["count"] == 5
    gap = hashes[:3] + block_hashes("other", 1) + hashes[3:]
    assert reader.call("lookup", cache=fmt, hashes=gap)["count"] == 3

    dst_blocks = [4, 8, 1, 3, 6]
    reader.call("fill", cache=fmt, seed=2, blocks=list(range(10)))
    result = reader.call("load", cache=fmt, hashes=hashes, blocks=dst_blocks)
    assert result["success"], result
    assert reader.call("digest", cache=fmt, blocks=dst_blocks) == expected


@pytest.mark.parametrize(
    ("reader_fmt", "reader_layout"),
    [("fp8_hadamard", "NHD"), ("fp8", "HND")],
    ids=["other_encoding_same_page_size", "HND_pages"],
)
def test_instances_whose_pages_differ_miss(
    shared_master, shared_instances, reader_fmt: str, reader_layout: str
) -> None:
    """An instance storing rotated keys (fp8's page size, other bytes) or HND pages never
    reads an NHD fp8 instance's blocks as its own: other keys, a miss; its own blocks it finds."""
    writer, reader = shared_instances
    address = shared_master.address
    cache = f"{reader_fmt}-{reader_layout}"
    fp_w = writer.call(
        "init_store", cache=cache, fmt="fp8", num_blocks=6, master=address, segment_size=SEGMENT
    )
    fp_r = reader.call(
        "init_store", cache=cache, fmt=reader_fmt, num_blocks=6, master=address,
        segment_size=SEGMENT, layout=reader_layout,
    )  # fmt: skip
    assert fp_w["fingerprint"] != fp_r["fingerprint"]
    hashes = block_hashes(f"mismatch-{cache}", 3)
    writer.call("fill", cache=cache, seed=3, blocks=[0, 1, 2])
    assert writer.call("offload", cache=cache, hashes=hashes, blocks=[0, 1, 2])["success"]
    assert reader.call("lookup", cache=cache, hashes=hashes)["count"] == 0
    reader.call("fill", cache=cache, seed=4, blocks=[3, 4])
    assert reader.call("offload", cache=cache, hashes=hashes[:2], blocks=[3, 4])["success"]
    assert reader.call("lookup", cache=cache, hashes=hashes)["count"] == 2


def test_offloaded_blocks_of_several_pages(shared_master, shared_instances) -> None:
    """block_size_factor 2: one store object holds two GPU pages of every buffer, in order; a
    batch larger than max_blocks_per_batch is split."""
    writer, reader = shared_instances
    for instance in shared_instances:
        instance.call(
            "init_store",
            cache="f2",
            fmt="hybrid",
            num_blocks=8,
            master=shared_master.address,
            segment_size=SEGMENT,
            block_size_factor=2,
            max_blocks_per_batch=2,
        )
    hashes = block_hashes("factor-2", 3)
    src, dst = [6, 1, 0, 7, 3, 2], [2, 3, 5, 4, 0, 1]
    expected = writer.call("fill", cache="f2", seed=8, blocks=src)
    assert writer.call("offload", cache="f2", hashes=hashes, blocks=src)["success"]
    assert reader.call("lookup", cache="f2", hashes=hashes)["count"] == 3
    assert reader.call("load", cache="f2", hashes=hashes, blocks=dst)["success"]
    assert reader.call("digest", cache="f2", blocks=dst) == expected
    # A spec the handler rejects is reported failed (the worker logs the handler's error).
    assert not reader.call("load", cache="f2", hashes=hashes, blocks=[0, 1, 2])["success"]


def test_no_traffic_leaves_loopback(sandbox, shared_master, shared_instances) -> None:
    """While pages move, every TCP socket of the master and the instances is on 127.0.0.1 (or a
    wildcard listener); inside the sandbox ``lo`` is the only interface."""
    writer, reader = shared_instances
    fmt = "bf16"
    for instance in shared_instances:
        instance.call(
            "init_store",
            cache="net",
            fmt=fmt,
            num_blocks=4,
            master=shared_master.address,
            segment_size=SEGMENT,
        )
    hashes = block_hashes("net", 4)
    writer.call("fill", cache="net", seed=3, blocks=[0, 1, 2, 3])
    assert writer.call("offload", cache="net", hashes=hashes, blocks=[0, 1, 2, 3])["success"]
    assert reader.call("load", cache="net", hashes=hashes, blocks=[3, 2, 1, 0])["success"]
    assert_loopback_only(sandbox, [writer.pid, reader.pid, shared_master.proc.pid])
