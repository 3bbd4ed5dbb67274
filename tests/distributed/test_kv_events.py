"""KV event records: equality and hashing (for cross-worker counting) and the aggregator."""

from __future__ import annotations

import pytest

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventAggregator,
)


def _stored(h: bytes) -> BlockStored:
    return BlockStored([h], None, [1, 2], 2, None, MEDIUM_GPU, None, extra_keys=[("k",)])


def test_equal_events_hash_equal() -> None:
    assert _stored(b"a") == _stored(b"a") and hash(_stored(b"a")) == hash(_stored(b"a"))
    assert _stored(b"a") != _stored(b"b")
    assert BlockRemoved([b"a"], MEDIUM_GPU) == BlockRemoved([b"a"], MEDIUM_GPU, None)
    assert AllBlocksCleared() != BlockRemoved([], None)


def test_aggregator_keeps_events_every_worker_saw() -> None:
    agg = KVEventAggregator(2)
    agg.add_events([_stored(b"a"), BlockRemoved([b"x"], MEDIUM_GPU)])
    agg.add_events([_stored(b"a"), AllBlocksCleared()])
    assert agg.get_common_events() == [_stored(b"a")]
    agg.increment_workers()
    assert agg.get_number_of_workers() == 3 and agg.get_common_events() == []
    agg.clear_events()
    agg.reset_workers()
    assert agg.get_number_of_workers() == 1 and agg.get_common_events() == []
    with pytest.raises(ValueError, match="num_workers: expected a positive int, got 0"):
        KVEventAggregator(0)
    with pytest.raises(TypeError, match="events: expected a list"):
        agg.add_events((AllBlocksCleared(),))  # type: ignore[arg-type]


def test_stored_event_takes_spec_fields_after_creation() -> None:
    event = _stored(b"a")
    event.kv_cache_spec_kind = "full_attention"
    assert event != _stored(b"a") and hash(event) != hash(_stored(b"a"))
