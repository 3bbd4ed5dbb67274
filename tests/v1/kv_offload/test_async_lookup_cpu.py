"""AsyncLookupManager paths upstream's tests leave out: a tier answering too few verdicts, and
requests of one flush probed separately with their own contexts."""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager


class Recording(AsyncLookupManager):
    def __init__(self, answers: dict[str, list[bool]]) -> None:
        super().__init__(tier_type="rec")
        self.answers = answers
        self.calls: list[tuple[str, int]] = []

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        self.calls.append((req_context.req_id, len(keys)))
        return self.answers[req_context.req_id]


def test_short_answers_count_as_misses_and_requests_probe_apart() -> None:
    mgr = Recording({"short": [True], "ok": [True, False]})
    keys = [make_offload_key(bytes([i]), 0) for i in range(4)]
    short, ok = ReqContext(req_id="short"), ReqContext(req_id="ok")
    try:
        for key, ctx in zip(keys, [short, short, ok, ok], strict=True):
            assert mgr.lookup(key, ctx) is None
        assert mgr.lookup(keys[0], ok) is None  # shared with "short": probed once, for it
        mgr.flush()
    finally:
        mgr.shutdown()
    assert sorted(mgr.calls) == [("ok", 2), ("short", 2)]
    assert [mgr.lookup(k, ok) for k in keys] == [False, False, True, False]
