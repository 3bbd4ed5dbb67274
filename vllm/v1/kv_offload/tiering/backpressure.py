"""Store back-pressure for secondary tiers (upstream v0.33's ``kv_offload.tiering.backpressure``).

A secondary tier that cannot keep up with cascades (a congested file system, a slow object
store) would pin primary rows for ever longer and delay the GPU's own stores. A
:class:`BackpressureDetector` watches how long the tier's store jobs take (or that they fail)
and a :class:`BackpressurePolicy` decides, store by store, whether a cascade is still submitted
to it. Loads from a pressured tier are never held back.

Latencies are normalised by size: seconds per MiB written (``s/MiB``), so jobs of any number
of blocks, of any block size, compare.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a number {bound}, got {value}")


class BackpressurePolicy(ABC):
    """Whether a store may go to a tier, given its detector's view of the tier's pressure."""

    @abstractmethod
    def should_store(self, detector: BackpressureDetector) -> bool:
        """True to submit the store, False to drop it."""

    @abstractmethod
    def on_store_skipped(self, num_blocks: int) -> None:
        """Count one dropped store of ``num_blocks`` blocks."""

    @abstractmethod
    def pop_stores_dropped(self) -> tuple[int, int]:
        """The (stores, blocks) dropped since the previous call; resets both to 0."""

    @abstractmethod
    def reset(self) -> None:
        """Forget all state (counters included)."""


class DropAccountingPolicy(BackpressurePolicy):
    """A policy that counts the stores and blocks it drops, for the tier's metrics.

    Subclasses decide (:meth:`should_store`); one with state of its own extends
    :meth:`reset` and calls this one.
    """

    def __init__(self) -> None:
        self._stores_dropped: int = 0
        self._blocks_dropped: int = 0

    def on_store_skipped(self, num_blocks: int) -> None:
        self._stores_dropped += 1
        self._blocks_dropped += num_blocks

    def pop_stores_dropped(self) -> tuple[int, int]:
        dropped = (self._stores_dropped, self._blocks_dropped)
        self._stores_dropped = self._blocks_dropped = 0
        return dropped

    def reset(self) -> None:
        self._stores_dropped = self._blocks_dropped = 0


class DropStorePolicy(DropAccountingPolicy):
    """Drop every store while the tier is under pressure."""

    def should_store(self, detector: BackpressureDetector) -> bool:
        return not detector.is_under_pressure()


class ThrottledDropPolicy(DropAccountingPolicy):
    """Drop a share of stores that grows with how far the latency EMA is above the high
    water mark: 0 at the mark, all of them at ``1 + ramp_factor`` times the mark.

    The share is ``min(1, (ema - high) / high / ramp_factor)``. Shares add up in an
    accumulator and a store is dropped each time it reaches 1, so the dropped count stays
    within one store of the target however the share changes; the fraction carries over
    between pressure episodes. Only an :class:`EMABackpressureDetector` has the EMA this
    needs.
    """

    def __init__(self, ramp_factor: float = 2.0) -> None:
        _check_positive("ramp_factor", ramp_factor)
        super().__init__()
        self._ramp_factor = ramp_factor
        self._drop_accumulator: float = 0.0

    def _drop_rate(self, detector: EMABackpressureDetector) -> float:
        high = detector._high
        if high <= 0:
            return 1.0
        overshoot = max(0.0, detector.store_latency_ema - high) / high
        return min(1.0, overshoot / self._ramp_factor)

    def should_store(self, detector: BackpressureDetector) -> bool:
        if not isinstance(detector, EMABackpressureDetector):
            raise TypeError(
                f"detector: expected an EMABackpressureDetector, got {type(detector).__name__}"
            )
        if not detector.is_under_pressure():
            return True
        rate = self._drop_rate(detector)
        if rate <= 0.0:
            return True
        if rate >= 1.0:
            return False
        self._drop_accumulator += rate
        if self._drop_accumulator < 1.0:
            return True
        self._drop_accumulator -= 1.0
        return False

    def reset(self) -> None:
        super().reset()
        self._drop_accumulator = 0.0


class BackpressureDetector(ABC):
    """Turns a tier's store completions into a pressure signal; its ``policy`` (by default a
    :class:`ThrottledDropPolicy`) turns the signal into store / drop decisions."""

    def __init__(self, policy: BackpressurePolicy | None = None) -> None:
        if policy is not None and not isinstance(policy, BackpressurePolicy):
            raise TypeError(f"policy: expected a BackpressurePolicy, got {type(policy).__name__}")
        self._policy: BackpressurePolicy = policy if policy is not None else ThrottledDropPolicy()

    @property
    def policy(self) -> BackpressurePolicy:
        return self._policy

    @abstractmethod
    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        """A store of ``num_bytes`` bytes succeeded after ``elapsed_s`` seconds."""

    def on_store_failed(self) -> None:
        """A store job finished with ``success=False`` (not pressure, unless overridden)."""
        return

    @abstractmethod
    def is_under_pressure(self) -> bool:
        """Whether the tier is currently too slow for new stores."""

    @abstractmethod
    def reset(self) -> None:
        """Forget all observations (the policy's state too)."""

    def update(self, submit_time: float, num_bytes: int) -> None:
        """Observe a successful store job submitted at ``submit_time`` (``time.monotonic()``
        seconds) that wrote ``num_bytes`` bytes; jobs that wrote nothing are ignored."""
        if num_bytes > 0:
            self.on_store_completed(time.monotonic() - submit_time, num_bytes)

    def should_store(self, num_blocks: int) -> bool:
        """Ask the policy about a store of ``num_blocks`` blocks, counting it if dropped."""
        if self._policy.should_store(self):
            return True
        self._policy.on_store_skipped(num_blocks)
        return False

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict | None:
        """Constructor keyword arguments suited to tiers of ``tier_type`` whose storage has
        ``locality`` (``"LOCAL"`` / ``"REMOTE"``), or None when this detector has none."""
        return None

    @property
    def stats(self) -> dict[str, float]:
        """Gauges the tier's metrics report, by short name."""
        return {}


class EMABackpressureDetector(BackpressureDetector):
    """Pressure from an exponential moving average (EMA) of store latency in s/MiB.

    - Warm-up: the first ``warmup_completions`` samples only seed the EMA (their mean); no
      pressure is signalled from latency before that.
    - Hysteresis: pressure starts when the EMA rises above ``high_water_s`` and ends when it
      falls below ``low_water_s`` (both s/MiB).
    - Idle decay: while pressured and no store completes (all are dropped), the EMA halves
      every ``decay_half_life_s`` seconds, so the tier is probed again eventually.
    - Cooldown: for ``cooldown_s`` seconds after pressure ends every other store is dropped,
      so a backlog does not flood the tier at once.
    - Healthy bypass: after ``_HEALTHY_THRESHOLD`` completions in a row below the low mark,
      stores skip the policy altogether.
    - Failures: with ``failure_threshold`` set, that many failed stores in a row put the tier
      under pressure (a full disk fails fast, which latency alone would read as healthy).

    Default marks: a local disk (NVMe) tier is pressured above 0.010 s/MiB (~100 MiB/s) and
    recovers below 0.002 s/MiB (~500 MiB/s); a network tier (``obj``, or any tier configured
    with ``"locality": "REMOTE"``) above 0.050 / below 0.010 s/MiB.
    """

    _MIB = 1 << 20

    DEFAULT_ALPHA = 0.15
    DEFAULT_WARMUP_COMPLETIONS = 10
    DEFAULT_DECAY_HALF_LIFE_S = 2.0
    DEFAULT_COOLDOWN_S = 1.0
    DEFAULT_FAILURE_THRESHOLD = 3
    _HEALTHY_THRESHOLD = 10
    # Failure pressure lifts the EMA this far above the high mark: past 1 + ramp_factor of the
    # default ThrottledDropPolicy, so every store drops until idle decay admits a probe.
    _FAILURE_EMA_FACTOR = 4.0

    LOCAL_HIGH_WATER_S = 0.010
    LOCAL_LOW_WATER_S = 0.002
    NETWORK_HIGH_WATER_S = 0.050
    NETWORK_LOW_WATER_S = 0.010

    _NETWORK_TIER_TYPES = frozenset({"obj"})
    # Tiers whose failed stores reflect the tier's health (a peer tier's failures are per
    # request, so they do not count).
    _STORAGE_TIER_TYPES = frozenset({"fs", "obj"})

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict:
        remote = locality is not None and locality.upper() == "REMOTE"
        if remote or tier_type in cls._NETWORK_TIER_TYPES:
            config: dict[str, Any] = {
                "high_water_s": cls.NETWORK_HIGH_WATER_S,
                "low_water_s": cls.NETWORK_LOW_WATER_S,
            }
        else:
            config = {"high_water_s": cls.LOCAL_HIGH_WATER_S, "low_water_s": cls.LOCAL_LOW_WATER_S}
        if tier_type in cls._STORAGE_TIER_TYPES:
            config["failure_threshold"] = cls.DEFAULT_FAILURE_THRESHOLD
        return config

    def __init__(
        self,
        high_water_s: float,
        low_water_s: float,
        alpha: float = DEFAULT_ALPHA,
        warmup_completions: int = DEFAULT_WARMUP_COMPLETIONS,
        decay_half_life_s: float = DEFAULT_DECAY_HALF_LIFE_S,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        failure_threshold: int | None = None,
        policy: BackpressurePolicy | None = None,
    ) -> None:
        _check_positive("high_water_s", high_water_s, allow_zero=True)
        _check_positive("low_water_s", low_water_s, allow_zero=True)
        _check_positive("decay_half_life_s", decay_half_life_s, allow_zero=True)
        _check_positive("cooldown_s", cooldown_s, allow_zero=True)
        if not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
            raise ValueError(f"alpha: expected a number in (0, 1], got {alpha!r}")
        if low_water_s > high_water_s:
            raise ValueError(
                f"low_water_s: expected <= high_water_s ({high_water_s}), got {low_water_s}"
            )
        if not isinstance(warmup_completions, int) or warmup_completions < 0:
            raise ValueError(
                f"warmup_completions: expected an int >= 0, got {warmup_completions!r}"
            )
        if failure_threshold is not None and (
            not isinstance(failure_threshold, int) or failure_threshold < 1
        ):
            raise ValueError(
                f"failure_threshold: expected None or an int >= 1, got {failure_threshold!r}"
            )
        super().__init__(policy=policy)
        self._alpha = alpha
        self._high = high_water_s
        self._low = low_water_s
        self._warmup_completions = warmup_completions
        self._decay_half_life_s = decay_half_life_s
        self._cooldown_s = cooldown_s
        self._failure_threshold = failure_threshold
        self._clear()

    def _clear(self) -> None:
        self._ema: float = 0.0
        self._under_pressure: bool = False
        self._completions: int = 0
        self._warmup_samples: list[float] = []
        # time.monotonic() of the last EMA change (0: never), the origin of idle decay.
        self._last_update: float = 0.0
        self._healthy_streak: int = 0
        # time.monotonic() when pressure last ended (0: not since the last onset).
        self._pressure_cleared_at: float = 0.0
        self._cooldown_count: int = 0
        self._consecutive_failures: int = 0
        # Failure pressure may start during warm-up and must be able to decay there too.
        self._failure_tripped: bool = False

    def _end_pressure(self, now: float) -> None:
        self._under_pressure = False
        self._failure_tripped = False
        self._pressure_cleared_at = now
        self._cooldown_count = 0

    def _start_pressure(self) -> None:
        self._under_pressure = True
        self._pressure_cleared_at = 0.0
        self._healthy_streak = 0

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        now = time.monotonic()
        sample = elapsed_s * self._MIB / num_bytes
        self._consecutive_failures = 0
        self._completions += 1
        if self._completions <= self._warmup_completions:
            self._warmup_samples.append(sample)
            if self._completions == self._warmup_completions:
                self._ema = sum(self._warmup_samples) / len(self._warmup_samples)
                self._last_update = now
            return
        # No idle decay here: a real sample replaces the guess decay stands in for.
        self._ema += self._alpha * (sample - self._ema)
        self._last_update = now
        if self._ema > self._high:
            self._start_pressure()
        elif self._ema < self._low:
            if self._under_pressure:
                self._end_pressure(now)
            self._failure_tripped = False
            self._healthy_streak += 1
        else:
            self._healthy_streak = 0

    def on_store_failed(self) -> None:
        if self._failure_threshold is None:
            return
        self._consecutive_failures += 1
        self._healthy_streak = 0
        if self._consecutive_failures < self._failure_threshold:
            return
        self._ema = max(self._ema, self._high * self._FAILURE_EMA_FACTOR)
        self._last_update = time.monotonic()
        self._failure_tripped = True
        self._start_pressure()

    def _apply_idle_decay(self, now: float) -> None:
        idle_s = now - self._last_update
        if idle_s > 0 and self._decay_half_life_s > 0:
            self._ema *= 0.5 ** (idle_s / self._decay_half_life_s)
            self._last_update = now

    def is_under_pressure(self) -> bool:
        warmed_up = self._completions >= self._warmup_completions
        if self._under_pressure and (warmed_up or self._failure_tripped):
            now = time.monotonic()
            self._apply_idle_decay(now)
            if self._ema < self._low:
                self._end_pressure(now)
        return self._under_pressure

    def is_healthy(self) -> bool:
        """Whether the last ``_HEALTHY_THRESHOLD`` or more completions were all below the low
        mark (and no pressure since): stores then bypass the policy."""
        return not self._under_pressure and self._healthy_streak >= self._HEALTHY_THRESHOLD

    def _in_cooldown(self) -> bool:
        return (
            self._pressure_cleared_at > 0
            and time.monotonic() - self._pressure_cleared_at < self._cooldown_s
        )

    def should_store(self, num_blocks: int) -> bool:
        pressured = self.is_under_pressure()
        if self.is_healthy():
            return True
        if not pressured and self._in_cooldown():
            self._cooldown_count += 1
            if self._cooldown_count % 2 == 0:
                self._policy.on_store_skipped(num_blocks)
                return False
        return super().should_store(num_blocks)

    def reset(self) -> None:
        self._clear()
        self._policy.reset()

    @property
    def store_latency_ema(self) -> float:
        """The EMA, s/MiB."""
        return self._ema

    @store_latency_ema.setter
    def store_latency_ema(self, value: float) -> None:
        self._ema = value

    @property
    def stats(self) -> dict[str, float]:
        return {
            "store_latency_ema": self._ema,
            "consecutive_store_failures": self._consecutive_failures,
        }


__all__ = [
    "BackpressureDetector",
    "BackpressurePolicy",
    "DropAccountingPolicy",
    "DropStorePolicy",
    "EMABackpressureDetector",
    "ThrottledDropPolicy",
]
