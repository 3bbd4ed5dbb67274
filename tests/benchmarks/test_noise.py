"""The benchmarks' noise handling on synthetic timings: spreads, flags, the paired roofline, the
load warning and the CPU-wait reading (vllm.benchmarks.noise), and the interleaved repeats
(vllm.benchmarks.timing). No timing is asserted."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from vllm.benchmarks import noise, timing

QUIET = noise.RowMachine(load_avg=[0.1, 0.1], cpu_wait_pct=0.0)
MB = 1_000_000


def _summary(
    op_s: list[float] | None = None,
    roofline: list[float] | None = None,
    baseline_s: list[float] | None = None,
    mode: str = "cold",
    machine: noise.RowMachine = QUIET,
    nbytes: int = MB,
) -> noise.Summary:
    """A row whose op moves ``nbytes`` in ~100 µs (10 GB/s) against a 40 GB/s roofline."""
    return noise.summarize(
        op_s or [100e-6] * 5,
        roofline or [40.0] * 5,
        nbytes,
        [1e-3] * 5 if baseline_s is None else baseline_s,
        mode,
        machine,
    )


def test_spread_is_the_interquartile_range_over_the_median() -> None:
    assert noise.spread_pct([10.0] * 5) == 0
    assert noise.spread_pct([7.0]) == 0
    # One outlier of five: the median ignores it, and so does the spread.
    assert noise.spread_pct([10, 10, 10, 10, 1000]) == 0
    # Two on one side reach the quartile: 2nd fastest 10, 4th fastest 1000, median 10.
    assert noise.spread_pct([10, 10, 10, 1000, 1000]) == pytest.approx(9900)
    assert noise.spread_pct([8, 9, 10, 11, 12]) == pytest.approx(20)
    assert noise.spread_pct([12, 8, 11, 9, 10]) == pytest.approx(20)  # order does not matter


def test_clean_row_has_no_flag_and_reports_medians() -> None:
    m = _summary(op_s=[100e-6, 101e-6, 99e-6, 100e-6, 102e-6])
    assert m.stats.flags == []
    assert m.op_s == pytest.approx(100e-6)
    assert m.baseline_s == pytest.approx(1e-3)
    assert m.stats.repeats == 5 and m.stats.op_us_samples[2] == pytest.approx(99)
    assert m.stats.op_spread_pct == pytest.approx(1)  # 2nd and 4th fastest: (101 - 100) / 100


def test_op_spread_over_the_limit_is_noisy() -> None:
    # Quartiles 100 and 140 µs around a median of 120: 33% > 25%.
    m = _summary(op_s=[90e-6, 100e-6, 120e-6, 140e-6, 150e-6])
    assert m.stats.op_spread_pct > noise.SPREAD_LIMIT_PCT
    assert m.stats.flags == ["noisy"]
    # Just under the limit: not flagged.
    m = _summary(op_s=[90e-6, 100e-6, 110e-6, 120e-6, 150e-6])
    assert m.stats.op_spread_pct < noise.SPREAD_LIMIT_PCT and m.stats.flags == []


def test_one_outlier_repeat_moves_neither_median_nor_flags() -> None:
    """The issue's row: one repeat 160x slower. Its median stays, and so does x baseline."""
    m = _summary(op_s=[100e-6, 100e-6, 15946e-6, 100e-6, 100e-6])
    assert m.op_s == pytest.approx(100e-6) and m.stats.flags == []
    assert m.baseline_s / m.op_s == pytest.approx(10)


def test_baseline_and_roofline_spreads_are_flagged_separately() -> None:
    m = _summary(baseline_s=[1e-3, 1e-3, 2e-3, 3e-3, 3e-3])
    assert m.stats.flags == ["noisy-baseline"]
    m = _summary(roofline=[20.0, 20.0, 40.0, 40.0, 40.0])
    assert m.stats.flags == ["noisy-roofline"]
    m = noise.summarize([1e-4] * 5, [40.0] * 5, MB, None, "cold", QUIET)  # no baseline timed
    assert m.baseline_s is None and m.stats.baseline_spread_pct is None and m.stats.flags == []


def test_percent_of_roofline_pairs_each_repeat_with_its_copy() -> None:
    """The machine halves in speed after the 2nd copy and recovers before the 3rd op: four
    repeats of five are at 25% of their own copy, while the median op (10 GB/s) against the
    median copy (20 GB/s) would say 50%."""
    op_s = [100e-6, 100e-6, 100e-6, 200e-6, 200e-6]
    roofline = [40.0, 40.0, 20.0, 20.0, 20.0]
    m = _summary(op_s=op_s, roofline=roofline, nbytes=MB)
    assert m.pct_roofline == pytest.approx(25)
    unpaired = 100 * (MB / statistics.median(op_s) / 1e9) / statistics.median(roofline)
    assert unpaired == pytest.approx(50)
    assert m.roofline_gbps == 20.0


def test_cold_row_above_the_roofline_is_flagged_warm_is_not() -> None:
    # 1 MB in 20 µs = 50 GB/s against a 40 GB/s copy: 125%.
    cold = _summary(op_s=[20e-6] * 5)
    assert cold.pct_roofline == pytest.approx(125)
    assert cold.stats.flags == ["over-roofline"]
    warm = _summary(op_s=[20e-6] * 5, mode="warm")
    assert warm.pct_roofline == pytest.approx(125) and warm.stats.flags == []


def test_cpu_wait_over_the_limit_is_contended() -> None:
    """Every repeat alike (spread 0) yet slowed: only the run-queue wait tells."""
    waited = noise.RowMachine([0.5, 0.6], cpu_wait_pct=noise.CPU_WAIT_LIMIT_PCT + 1)
    m = _summary(machine=waited)
    assert m.stats.op_spread_pct == 0 and m.stats.flags == ["contended"]
    unknown = noise.RowMachine([None, None], cpu_wait_pct=None)
    assert _summary(machine=unknown).stats.flags == []


def test_flags_keep_their_order() -> None:
    m = _summary(
        op_s=[10e-6, 10e-6, 20e-6, 30e-6, 30e-6],
        baseline_s=[1e-3, 1e-3, 2e-3, 3e-3, 3e-3],
        roofline=[2.0, 2.0, 4.0, 4.0, 4.0],
        machine=noise.RowMachine([3.0, 3.0], 50.0),
    )
    assert m.stats.flags == list(noise.FLAGS)


def test_load_above_the_cpus_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([2.5, 3.0, 4.25])
    monkeypatch.setattr(noise.os, "getloadavg", lambda: (next(readings), 0.0, 0.0))
    monkeypatch.setattr(noise.os, "cpu_count", lambda: 2)
    warnings: list[str] = []
    watch = noise.MachineWatch(warnings.append)
    watch.start_row()
    assert watch.end_row().load_avg == [2.5, 3.0]
    watch.start_row()
    assert watch.end_row().load_avg == [3.0, 4.25]
    assert warnings == []  # nothing until the run ends
    load = watch.finish()
    assert load == noise.Load(cores=2, start=2.5, end=4.25) and load.overloaded
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("warning: load average 2.50 at start, 4.25 at end, above the 2")


@pytest.mark.parametrize(
    ("start", "end", "warned"), [(1.0, 2.0, False), (2.01, 0.5, True), (0.5, 2.01, True)]
)
def test_load_is_checked_at_start_and_end(
    monkeypatch: pytest.MonkeyPatch, start: float, end: float, warned: bool
) -> None:
    monkeypatch.setattr(noise.os, "cpu_count", lambda: 2)
    load = noise.Load(noise.cpu_count(), start, end)
    assert load.overloaded is warned and (load.warning() is not None) is warned


def test_no_load_average_no_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> tuple[float, float, float]:
        raise OSError("no load average here")

    monkeypatch.setattr(noise.os, "getloadavg", unavailable)
    warnings: list[str] = []
    assert noise.load_average() is None
    assert not noise.MachineWatch(warnings.append).finish().overloaded and warnings == []


def test_cpu_wait_is_the_run_queue_delay_over_the_wall_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = iter([1_000_000_000, 1_300_000_000])
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(noise, "cpu_wait_ns", lambda: next(waits))
    monkeypatch.setattr(noise.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(noise, "load_average", lambda: None)
    watch = noise.MachineWatch(lambda _: None)
    assert watch.end_row().cpu_wait_pct == pytest.approx(15)  # 0.3 s of 2 s


def test_cpu_wait_reading() -> None:
    wait = noise.cpu_wait_ns()
    if wait is None:
        pytest.skip("no /proc/self/task/*/schedstat on this platform")
    assert wait >= 0


def _row(flags: list[str], load: list[float | None]) -> noise.RepeatStats:
    return noise.RepeatStats(
        repeats=5, roofline_gbps_samples=[30.0, 20.0, 40.0], flags=flags, load_avg=load
    )


def test_notes_explain_the_flags_present_and_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noise.os, "cpu_count", lambda: 2)
    quiet = noise.notes([_row([], [0.5, 0.7]), _row([], [0.7, 1.0])])
    assert quiet[0].startswith("median of 5 repeats") and "interquartile range" in quiet[0]
    assert quiet[1].startswith("flags: none") and len(quiet) == 2
    flagged = noise.notes([_row(["noisy", "contended"], [1.5, 1.0]), _row([], [1.0, 3.5])])
    assert flagged[1].startswith("noisy: the op's repeats spread over 25% of their median")
    assert flagged[2].startswith("contended: ")
    assert flagged[3].startswith("warning: load average 1.50 at start, 3.50 at end")
    assert len(flagged) == 4


def test_run_json_and_row_json() -> None:
    rows = [_row(["noisy"], [0.1, 0.2]), _row([], [0.2, 0.3])]
    doc = noise.run_json(rows)
    assert doc["roofline_gbps"] == 30.0 and doc["roofline_gbps_range"] == [20.0, 40.0]
    assert doc["repeats"] == 5 and doc["flagged_rows"] == 1 and doc["warnings"] == []
    assert set(doc["flag_legend"]) == set(noise.FLAGS)
    assert doc["load"]["start"] == 0.1 and doc["load"]["end"] == 0.3
    assert not doc["load"]["overloaded"]
    assert list(noise.row_json(rows[0]))[0] == "repeats"
    assert noise.roofline_caption(rows) == (
        "roofline (copy, next to each row): 30.0 GB/s median, 20.0-40.0"
    )


def test_rows_without_repeats_count_their_roofline_once() -> None:
    @dataclasses.dataclass
    class Unrepeated(noise.RepeatStats):
        roofline_gbps: float = 0.0

    rows = [Unrepeated(roofline_gbps=30.0), Unrepeated(roofline_gbps=10.0)]
    assert noise.roofline_range(rows) == (20.0, 10.0, 30.0)
    assert noise.roofline_range([]) is None and noise.run_json([])["roofline_gbps"] is None


def test_warning_over_a_progress_bar(capsys: pytest.CaptureFixture) -> None:
    noise.print_warning("warning: x")
    noise.print_warning("warning: y", over_bar=True)
    err = capsys.readouterr().err.split("\n")
    assert err[0] == "warning: x"
    assert err[1].startswith("\rwarning: y") and len(err[1]) == 121


def test_fixed_width_aligns() -> None:
    table = noise.fixed_width(["a", "num", "f"], [["xy", "1", ""], ["z", "100", "noisy"]], {0, 2})
    assert table.splitlines() == ["a   num  f", "--  ---  -----", "xy    1", "z   100  noisy"]


def test_repeats_interleave_and_warm_up_once() -> None:
    events: list[str] = []
    timed = [
        timing.Timed(lambda: events.append("copy"), 1, warmup=False),
        timing.Timed(lambda: events.append("op"), 1, lambda: events.append("flush")),
        timing.Timed(lambda: events.append("base"), 1),
    ]
    samples = timing.time_repeats(timed, torch.device("cpu"), 3, 0.0)
    assert [len(s) for s in samples] == [3, 3, 3]
    # Repeat 1: op and baseline warmed up (untimed call first); then one timed call each.
    first = ["copy", "flush", "op", "flush", "op", "base", "base"]
    assert events == first + ["copy", "flush", "op", "base"] * 2
