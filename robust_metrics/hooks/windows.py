"""Each rank's step windows: the ready means the straggler and slow-rank rules compare.

Derived in PromQL (`rate(x_sum[1m]) / rate(x_count[1m])`), every window of every rank costs each
rule evaluation a pass over that rank's raw samples, so Prometheus' work grows as ranks x
windows. The hook sees every step exactly, on the rank's own clock, so it keeps the windows and
publishes their values (docs/architecture.md, "edge first"); the rules compare them with instant
selectors and keep every threshold.

A window holds the steps that ended within its length before the rank's last step end. Values
change only at step ends: a hung rank's last windows stay served (its process lives, its files
stay), a dead rank's gauges vanish with its process, and a restarted rank starts new windows.
A window is not cut at a phase change: after a checkpoint the minute still ends at the last step.
The hook leaves out the first step of a process and the first after a return to training
(`hooks/steps.py`): timed from its first forward, without the wait before it, it is no step time,
and a restarted job's first window would be that step alone.

The lengths follow the rules' time scale (`ROBUST_METRICS_TIME_SCALE`, as `robust-metrics rules
--time-scale`); the `window` label names the production length whatever the scale.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass

from robust_metrics import schema
from robust_metrics.hooks.metric_store import MetricStore, Series

__all__ = ["PUBLISHED", "WINDOW_SECONDS", "StepWindows", "WindowPublisher", "WindowStats",
           "published_value"]

WINDOW_SECONDS: dict[str, float] = {"1m": 60.0, "2m": 120.0, "5m": 300.0}
"""Window names (the `window` label) and their production lengths."""

# Which windows each published metric has: the ones a rule reads, no more (series budget).
PUBLISHED: tuple[tuple[schema.MetricSpec, tuple[str, ...]], ...] = (
    (schema.STEP_COMPUTE_MEAN, ("1m", "2m", "5m")),
    (schema.STEP_DURATION_MEAN, ("2m", "5m")),
    (schema.STEP_COMPUTE_VARIATION, ("1m",)),
    (schema.WINDOW_STEPS, ("1m",)),
)

_Mark = tuple[float, float, float, float, float]  # time, steps, duration, compute, squares
_TRIM_AT = 4096  # marks kept before the training thread trims them itself (amortised)


@dataclass(frozen=True)
class WindowStats:
    """The steps of one window: how many, their mean time and compute, compute's spread."""

    steps: float
    duration_mean: float
    compute_mean: float
    compute_variation: float  # standard deviation / mean of compute per step


class StepWindows:
    """Cumulative sums marked at every step end; a window is the difference of two marks.

    `add` is the training thread's only call (one tuple append, and now and then a trim, so that
    memory stays bounded by the longest window's steps even where nothing reads the values);
    `stats` and `trim` run where values are read, under a lock of their own.
    """

    def __init__(self, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale={time_scale!r}: must be > 0")
        self.lengths = {name: seconds * time_scale for name, seconds in WINDOW_SECONDS.items()}
        self._longest = max(self.lengths.values())
        self._marks: list[_Mark] = [(-math.inf, 0.0, 0.0, 0.0, 0.0)]
        self._lock = threading.Lock()
        self._trim_at = _TRIM_AT

    def add(self, at: float, duration: float, compute: float) -> None:
        """One timed step that ended at `at` (Unix time, the rank's clock)."""
        marks = self._marks
        _, steps, durations, computes, squares = marks[-1]
        marks.append((at, steps + 1.0, durations + duration, computes + compute,
                      squares + compute * compute))
        if len(marks) >= self._trim_at:  # nothing may read the store (no scrape, no sink)
            self.trim()
            self._trim_at = 2 * len(self._marks) + _TRIM_AT

    @property
    def last_step(self) -> float | None:
        """When the newest step ended, or None before the first."""
        at = self._marks[-1][0]
        return None if at == -math.inf else at

    def stats(self, window: str) -> WindowStats | None:
        """The steps that ended within `window` before the last step, or None before any."""
        with self._lock:
            marks = self._marks
            last = marks[-1]
            if last[0] == -math.inf:
                return None
            # the mark before the window's first step holds the sums the window starts from
            start = bisect.bisect_right(marks, last[0] - self.lengths[window],
                                        key=lambda mark: mark[0]) - 1
            first = marks[max(start, 0)]
        steps = last[1] - first[1]
        compute = last[3] - first[3]
        squares = last[4] - first[4]
        variance_ratio = squares * steps / (compute * compute) - 1.0 if compute > 0 else 0.0
        return WindowStats(steps, (last[2] - first[2]) / steps, compute / steps,
                           math.sqrt(max(variance_ratio, 0.0)))

    def trim(self) -> None:
        """Forget marks older than the longest window needs (keeping the one before it)."""
        with self._lock:
            marks = self._marks
            oldest = marks[-1][0] - self._longest
            keep = bisect.bisect_right(marks, oldest, key=lambda mark: mark[0]) - 1
            if keep > 0:
                del marks[:keep]


class WindowPublisher:
    """Sets the window gauges of a `MetricStore` from `StepWindows` whenever the store is read
    (a flush, a scrape) and a step ended since the last read."""

    def __init__(self, store: MetricStore, windows: StepWindows) -> None:
        self.store, self.windows = store, windows
        self._published_at: float | None = None
        self._series: list[tuple[Series, str, str]] = []

    def refresh(self) -> None:
        last = self.windows.last_step
        if last is None or last == self._published_at:
            return
        self.windows.trim()
        if not self._series:  # created at the first step: no placeholder value is ever served
            self._series = [(self.store.series(spec, window=window), spec.name, window)
                            for spec, windows in PUBLISHED for window in windows]
        stats = {name: self.windows.stats(name) for name in self.windows.lengths}
        for series, metric, window in self._series:
            found = stats[window]
            if found is not None:
                series.set(published_value(found, metric))
        self._published_at = last


def published_value(stats: WindowStats, metric: str) -> float:
    """The value `metric` (a name in PUBLISHED) publishes for a window's `stats`."""
    if metric == schema.STEP_COMPUTE_MEAN.name:
        return stats.compute_mean
    if metric == schema.STEP_DURATION_MEAN.name:
        return stats.duration_mean
    if metric == schema.STEP_COMPUTE_VARIATION.name:
        return stats.compute_variation
    return stats.steps
