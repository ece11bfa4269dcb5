"""Per-rank metric values held as plain Python numbers.

The training loop only touches Python floats (an attribute add costs tens of nanoseconds); sinks
read the values: the in-process `/metrics` collector at scrape time, the multiprocess writer at
flush time, OpenTelemetry through observable callbacks. One store per rank process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from robust_metrics.schema import MetricSpec, MetricType

__all__ = ["MetricStore", "Sample", "Series", "families"]


@dataclass(eq=False)
class Series:
    """One labelled series. Counters and gauges use `value`; summaries `count` and `sum`."""

    spec: MetricSpec
    labels: tuple[str, ...]
    value: float = 0.0
    count: float = 0.0
    sum: float = 0.0
    updated: float = field(default_factory=time.time)

    def label_map(self) -> dict[str, str]:
        """Label names to values."""
        return dict(zip(self.spec.labels, self.labels, strict=True))

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value
        self.updated = time.time()

    def observe(self, amount: float) -> None:
        self.count += 1.0
        self.sum += amount


@dataclass(frozen=True)
class Sample:
    """One exposed sample: what a sink writes."""

    series: Series
    name: str
    value: float


class MetricStore:
    """All series of one rank, created on first use with the rank's base labels."""

    def __init__(self, base_labels: dict[str, str]) -> None:
        self.base_labels = dict(base_labels)
        self._series: dict[tuple[str, tuple[str, ...]], Series] = {}
        self._lock = threading.Lock()
        self._refreshers: list[Callable[[], None]] = []

    def on_read(self, refresh: Callable[[], None]) -> None:
        """Run `refresh` before every read, for values kept elsewhere (collective stats)."""
        self._refreshers.append(refresh)

    def series(self, spec: MetricSpec, *, initial: float = 0.0, **extra: str) -> Series:
        """The series of `spec` for this rank plus `extra` labels (get or create). A new series
        starts at `initial`, so a writer flushing concurrently never sees a placeholder 0."""
        values = tuple(
            str(extra[name]) if name in extra else self.base_labels.get(name, "")
            for name in spec.labels
        )
        key = (spec.name, values)
        found = self._series.get(key)
        if found is None:
            with self._lock:
                found = self._series.setdefault(key, Series(spec, values, value=initial))
        return found

    def all_series(self) -> list[Series]:
        with self._lock:
            return list(self._series.values())

    def samples(self) -> Iterator[Sample]:
        """Every sample with its exposed name, in creation order."""
        for refresh in self._refreshers:
            refresh()
        for s in self.all_series():
            if s.spec.type is MetricType.SUMMARY:
                yield Sample(s, f"{s.spec.name}_count", s.count)
                yield Sample(s, f"{s.spec.name}_sum", s.sum)
            else:
                yield Sample(s, s.spec.name, s.value)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client Collector protocol, for the in-process `/metrics` server."""
        return families(self.samples())

    def labels_of(self, spec: MetricSpec) -> tuple[str, ...]:
        """The label values of `spec`'s series of this rank (its base labels, "" for others)."""
        return tuple(self.base_labels.get(name, "") for name in spec.labels)


def families(samples: Iterable[Sample]) -> Iterator[Metric]:
    """Samples grouped into prometheus_client metric families, in order of first appearance."""
    found: dict[str, Metric] = {}
    for sample in samples:
        spec = sample.series.spec
        family = found.get(spec.name)
        if family is None:
            family = Metric(spec.base_name, spec.help, str(spec.type))
            found[spec.name] = family
        family.add_sample(sample.name, sample.series.label_map(), sample.value)
    yield from found.values()
