"""Error paths of the tiering core that upstream's tests do not pin: bad back-pressure settings
(detector, policy, factory ``"backpressure"`` entry, spec defaults), bad manager arguments and
broken tier reports, and the request-context parser's tolerance of bad user input."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    _create_req_context,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    ReqContext,
    RequestOffloadingContext,
    TierFilter,
    TierMatcher,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.backpressure import (
    BackpressureDetector,
    DropStorePolicy,
    EMABackpressureDetector,
    ThrottledDropPolicy,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.spec import (
    ReservedLabelError,
    TieringOffloadingSpec,
    _with_backpressure_defaults,
)

CTX = ReqContext(req_id="r")


def view(rows: int = 4, row_bytes: int = 16) -> memoryview:
    return memoryview(torch.zeros((rows, row_bytes), dtype=torch.int8).numpy())


def region(rows: int = 4) -> MagicMock:
    mock = MagicMock()
    mock.create_kv_memoryview.return_value = view(rows)
    return mock


def manager_with(tier_cls: type[SecondaryTierManager] = ExampleSecondaryTierManager, **kw):
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region())
    tier = tier_cls(MagicMock(), primary.get_kv_memoryview(), "t", **kw)
    return TieringOffloadingManager(primary, [tier]), tier


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"high_water_s": 1.0, "low_water_s": 2.0}, "low_water_s: expected <= high_water_s"),
        ({"high_water_s": -1.0, "low_water_s": -2.0}, "high_water_s: expected a number >= 0"),
        ({"high_water_s": 1.0, "low_water_s": 0.5, "alpha": 0.0}, r"alpha: expected .*\(0, 1\]"),
        ({"high_water_s": 1.0, "low_water_s": 0.5, "failure_threshold": 0}, "failure_threshold"),
        ({"high_water_s": 1.0, "low_water_s": 0.5, "warmup_completions": -1}, "warmup"),
        ({"high_water_s": 1.0, "low_water_s": 0.5, "cooldown_s": -1}, "cooldown_s"),
    ],
)
def test_ema_detector_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EMABackpressureDetector(**kwargs)


def test_policies_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ramp_factor: expected a number > 0"):
        ThrottledDropPolicy(ramp_factor=0)
    with pytest.raises(TypeError, match="policy: expected a BackpressurePolicy"):
        EMABackpressureDetector(1.0, 0.5, policy="DropStorePolicy")  # type: ignore[arg-type]

    class Constant(BackpressureDetector):
        def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
            return

        def is_under_pressure(self) -> bool:
            return True

        def reset(self) -> None:
            return

    # The throttled policy needs the EMA; the plain drop policy works with any detector.
    with pytest.raises(TypeError, match="detector: expected an EMABackpressureDetector"):
        Constant().should_store(1)
    detector = Constant(policy=DropStorePolicy())
    assert detector.should_store(3) is False
    assert detector.policy.pop_stores_dropped() == (1, 3)


def test_detector_ignores_empty_stores_and_reports_stats() -> None:
    bp = EMABackpressureDetector(1.0, 0.5, warmup_completions=0)
    bp.update(submit_time=0.0, num_bytes=0)
    assert bp.stats == {"store_latency_ema": 0.0, "consecutive_store_failures": 0}


def test_factory_builds_the_configured_detector() -> None:
    config = {
        "type": "example",
        "backpressure": {"backpressure_cls": "EMABackpressureDetector", "alpha": 0.5},
    }
    tier = SecondaryTierFactory.create_secondary_tier(config, view(), MagicMock())
    bp = tier.bp_detector
    assert isinstance(bp, EMABackpressureDetector) and isinstance(bp.policy, ThrottledDropPolicy)
    # The detector's defaults for the tier type fill what the config leaves out.
    assert (bp._alpha, bp._high) == (0.5, EMABackpressureDetector.LOCAL_HIGH_WATER_S)
    assert config["backpressure"] == {
        "backpressure_cls": "EMABackpressureDetector",
        "alpha": 0.5,
    }
    dotted = {
        "backpressure_cls": "vllm.v1.kv_offload.tiering.backpressure.EMABackpressureDetector",
        "policy_cls": "DropStorePolicy",
    }
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "example", "backpressure": dotted}, view(), MagicMock()
    )
    assert isinstance(tier.bp_detector, EMABackpressureDetector)
    assert isinstance(tier.bp_detector.policy, DropStorePolicy)
    unconfigured = SecondaryTierFactory.create_secondary_tier({"type": "example"}, view(), None)
    assert unconfigured.bp_detector is None


@pytest.mark.parametrize(
    "bp, error, match",
    [
        ([], TypeError, "backpressure: expected a dict"),
        ({}, ValueError, "expected a 'backpressure_cls'"),
        ({"backpressure_cls": "NoSuchDetector"}, ValueError, "NoSuchDetector: expected a "),
        ({"backpressure_cls": "DropStorePolicy"}, ValueError, "a BackpressureDetector class"),
        (
            {
                "backpressure_cls": "EMABackpressureDetector",
                "policy_cls": "EMABackpressureDetector",
            },
            ValueError,
            "a BackpressurePolicy class",
        ),
    ],
)
def test_factory_rejects_bad_backpressure_entries(bp, error, match) -> None:
    with pytest.raises(error, match=match):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "example", "backpressure": bp}, view(), MagicMock()
        )


def test_spec_merges_instance_backpressure_defaults_under_each_tier() -> None:
    defaults = {"backpressure_cls": "EMABackpressureDetector", "alpha": 0.2}
    tiers = [{"type": "example"}, {"type": "example", "backpressure": {"alpha": 0.9}}]
    merged = [_with_backpressure_defaults(tier, defaults) for tier in tiers]
    assert [m["backpressure"] for m in merged] == [defaults, {**defaults, "alpha": 0.9}]
    assert tiers[1]["backpressure"] == {"alpha": 0.9}  # the configs are left as they are
    # Without instance defaults, only a tier that asks for back-pressure gets a detector.
    assert _with_backpressure_defaults(tiers[0], None) == {"type": "example"}
    assert _with_backpressure_defaults({"type": "e", "backpressure": {}}, None) == {
        "type": "e",
        "backpressure": {},
    }
    with pytest.raises(ValueError, match="backpressure: expected a dict"):
        _with_backpressure_defaults({"type": "e", "backpressure": "ema"}, defaults)
    detectors = [
        SecondaryTierFactory.create_secondary_tier(m, view(), MagicMock()).bp_detector
        for m in merged
    ]
    assert [bp._alpha for bp in detectors] == [0.2, 0.9]  # type: ignore[union-attr]


def test_spec_rejects_bad_tier_lists_and_reserved_labels() -> None:
    with pytest.raises(ValueError, match=r"secondary_tiers'\]: expected a list"):
        TieringOffloadingSpec.config_info_keys({"secondary_tiers": {"type": "example"}})
    with pytest.raises(ValueError, match=r"secondary_tiers'\]\[0\]: expected a dict"):
        TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": ["example"]})

    class Labelled(ExampleSecondaryTierManager):
        @classmethod
        def config_info_keys(cls, tier_config):
            return ("tier",)

    SecondaryTierFactory._registry["labelled"] = lambda: Labelled
    try:
        with pytest.raises(ReservedLabelError, match="reserved label 'tier'") as info:
            TieringOffloadingSpec.config_info_keys({"secondary_tiers": [{"type": "labelled"}]})
        assert isinstance(info.value, ValueError)
    finally:
        del SecondaryTierFactory._registry["labelled"]


def test_manager_rejects_bad_arguments_and_reports() -> None:
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region())
    with pytest.raises(TypeError, match="tier_poll_interval_s: expected a number"):
        TieringOffloadingManager(primary, [], tier_poll_interval_s="1ms")  # type: ignore[arg-type]
    manager, tier = manager_with()
    with pytest.raises(RuntimeError, match="finished but never started"):
        manager.on_request_finished(CTX)
    manager.on_new_request(CTX)
    with pytest.raises(RuntimeError, match="complete_store without a prepared store"):
        manager.complete_store([], CTX)
    tier.completed_jobs.append(JobResult(42, True))
    with pytest.raises(RuntimeError, match="reported job 42, which it does not run"):
        manager.lookup(make_offload_key(b"k", 0), CTX)
    manager.shutdown()


def test_partial_promotion_reporting_unknown_keys_is_an_error() -> None:
    manager, tier = manager_with()
    keys = [make_offload_key(b"a", 0), make_offload_key(b"b", 0)]
    job = TransferJob(manager._next_job_id(), keys, np.array([0, 1]), True, CTX)
    manager._register_job(job, 0)
    tier.completed_jobs.append(
        JobResult(job.job_id, False, successful_keys=[make_offload_key(b"z", 0)])
    )
    with pytest.raises(RuntimeError, match="reports keys it never had"):
        manager._process_finished_jobs()
    manager.shutdown()


def test_a_tier_view_without_rows_is_rejected() -> None:
    with pytest.raises(ValueError, match="primary_kv_view: expected a"):
        ExampleSecondaryTierManager(MagicMock(), memoryview(b"x").cast("B", ()), "example")
    with pytest.raises(TypeError, match="custom_param: expected an int"):
        ExampleSecondaryTierManager(MagicMock(), view(), "example", custom_param="3")


def test_request_context_reads_the_load_tiers_of_a_request() -> None:
    request = SimpleNamespace(
        request_id="q", kv_transfer_params={"kv_load_tiers": [{"medium": "cpu"}, 7]}
    )
    ctx = _create_req_context(request)  # type: ignore[arg-type]
    assert ctx.req_id == "q" and ctx.kv_hints is None
    assert ctx.load_tier_filter == TierFilter(matchers=(TierMatcher(medium=Medium.CPU),))
    plain = _create_req_context(SimpleNamespace(request_id="p", kv_transfer_params=None))  # type: ignore[arg-type]
    assert plain.load_tier_filter is TierFilter.ALL


class _RetryingTier(ExampleSecondaryTierManager):
    def lookup(self, key, req_context) -> LookupResult:
        return LookupResult.RETRY


def test_load_tier_filter_hides_a_tier_from_lookups() -> None:
    manager, _ = manager_with(_RetryingTier)
    key = make_offload_key(b"k", 0)
    assert manager.lookup(key, CTX) is LookupResult.RETRY
    storage_only = ReqContext("s", load_tier_filter=TierFilter((TierMatcher(Medium.STORAGE),)))
    assert manager.lookup(key, storage_only) is LookupResult.MISS
    manager.shutdown()


class _Iterable(ExampleSecondaryTierManager):
    """Reports through a generator, as a tier may."""

    def get_finished_jobs(self) -> Iterable[JobResult]:
        yield from super().get_finished_jobs()

    def on_new_request(self, req_context) -> RequestOffloadingContext:
        return RequestOffloadingContext()


def test_generator_reports_are_consumed() -> None:
    manager, tier = manager_with(_Iterable)
    manager.on_new_request(CTX)
    keys = [make_offload_key(b"a", 0)]
    out = manager.prepare_store(keys, CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    assert manager._jobs and tier.get_num_chunks() == 1
    manager._process_finished_jobs()
    assert not manager._jobs
    manager.shutdown()
