"""Where a rank's metrics go, chosen by name: `multiprocess`, `http`, `otel`, or `null`.

- `multiprocess` writes prometheus_client's multiprocess files into `ROBUST_METRICS_DIR`, the
  format the node sidecar (and any `MultiProcessCollector`) reads. A rank that hangs keeps its last
  written values on disk, so the sidecar still serves them.
- `http` serves `/metrics` from this process (no sidecar: a laptop, one pod per rank).
- `otel` exports the same names through the OpenTelemetry SDK's global meter provider.
- `null` publishes nothing (tests, benchmarks).

The sinks read at scrape time (`http`, `otel`) also publish the rank's step age, which the
sidecar computes from the files for the `multiprocess` sink: rules read one series for it however
the rank is scraped.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.metrics_core import Metric

from robust_metrics import schema
from robust_metrics.hooks.metric_store import MetricStore, Sample, Series, families
from robust_metrics.rankfolder.metricfile import MetricFile, file_name, metric_key
from robust_metrics.schema import MetricType

__all__ = ["HttpSink", "MultiprocessSink", "NullSink", "OtelSink", "Sink", "make_sink",
           "step_age"]

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Publishes a `MetricStore`. `flush` runs at step boundaries, at most every flush interval."""

    def flush(self, store: MetricStore) -> None: ...

    def close(self, store: MetricStore) -> None: ...


class NullSink:
    def flush(self, store: MetricStore) -> None:
        pass

    def close(self, store: MetricStore) -> None:
        pass


def step_age(store: MetricStore, now: float | None = None) -> Sample | None:
    """Seconds since the rank's last step (or its return to training) as of `now`, on the rank's
    own clock, once it has stepped: what the sidecar publishes from the files (there as of the
    rank's last write), for a rank scraped in-process. Computed when read, so never written to
    the files, where it would be stale."""
    last = store.series(schema.LAST_STEP_TIMESTAMP).value
    if last <= 0:
        return None
    age = max(0.0, (time.time() if now is None else now) - last)
    spec = schema.RANK_STEP_AGE
    return Sample(Series(spec, store.labels_of(spec), value=age), spec.name, age)


class _ScrapedStore:
    """The store as a scrape of this process reads it: its series and the rank's step age."""

    def __init__(self, store: MetricStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        age = step_age(self.store)
        return families([*self.store.samples(), *([age] if age else [])])


def _file_prefix(spec_type: MetricType, gauge_mode: str) -> str:
    if spec_type is MetricType.GAUGE:
        return f"gauge_{gauge_mode}"
    return str(spec_type)


class MultiprocessSink:
    """Writes the rank folder's multiprocess files, one per metric type, named by pid.

    The file format and its writer belong to `robust_metrics.rankfolder.metricfile`; this sink maps
    the store's series onto it. When the files vanish (the folder was removed under a running job)
    they are created again on the next flush, so the sidecar sees the rank again; when that fails
    (a full disk, a folder that cannot be made) `flush` raises OSError, which the hook counts.
    """

    def __init__(self, directory: str, pid: int | None = None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self._files: dict[str, MetricFile] = {}
        self._keys: dict[tuple[int, str], tuple[MetricFile, int]] = {}
        self.on_reopen: Callable[[], None] | None = None
        """Runs after vanished files were started again (the hook rewrites its identity)."""

    def _file(self, prefix: str) -> MetricFile:
        mmap_file = self._files.get(prefix)
        if mmap_file is None:
            path = os.path.join(self.directory, file_name(prefix, self.pid))
            mmap_file = self._files[prefix] = MetricFile(path)
        return mmap_file

    def _slot(self, series: Series, name: str) -> tuple[MetricFile, int]:
        key = (id(series), name)
        slot = self._keys.get(key)
        if slot is None:
            spec = series.spec
            key_text = metric_key(spec.base_name, name, list(spec.labels), list(series.labels),
                                  spec.help)
            metric_file = self._file(_file_prefix(spec.type, spec.gauge_mode))
            slot = self._keys[key] = (metric_file, metric_file.slot(key_text))
        return slot

    def flush(self, store: MetricStore) -> None:
        if any(f.vanished() for f in self._files.values()):
            self._reopen()
        gauge, keys = MetricType.GAUGE, self._keys
        for sample in store.samples():
            series = sample.series
            slot = keys.get((id(series), sample.name)) or self._slot(series, sample.name)
            slot[0].set(slot[1], sample.value, series.updated if series.spec.type is gauge else 0.0)
        for metric_file in self._files.values():
            metric_file.sync()

    def _reopen(self) -> None:
        """Start new files after the old ones were deleted; their values are rewritten in full."""
        for metric_file in self._files.values():
            metric_file.close()
        self._files.clear()
        self._keys.clear()
        log.warning("robust-metrics: metric files in %s vanished; writing them again",
                    self.directory)
        os.makedirs(self.directory, exist_ok=True)
        if self.on_reopen is not None:
            self.on_reopen()

    def close(self, store: MetricStore) -> None:
        try:
            self.flush(store)
        finally:
            for metric_file in self._files.values():
                metric_file.close()
            self._files.clear()
            self._keys.clear()


class HttpSink:
    """Serves the store on `/metrics` from a daemon thread of this process."""

    def __init__(self, store: MetricStore, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ScrapedStore(store))  # type: ignore[arg-type]
        self.port = port
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)

    def flush(self, store: MetricStore) -> None:
        pass  # scrapes read the store directly

    def close(self, store: MetricStore) -> None:
        self._server.shutdown()
        self._server.server_close()


class OtelSink:
    """Exports the store through OpenTelemetry observable instruments with the schema's names."""

    def __init__(self, store: MetricStore) -> None:
        from opentelemetry import metrics
        from opentelemetry.metrics import CallbackOptions, Observation

        meter = metrics.get_meter("robust_metrics")
        self._instruments = []
        specs = {s.spec.name: s.spec for s in store.all_series()}
        for spec in schema.all_metrics(schema.Source.RANK):
            specs.setdefault(spec.name, spec)

        def callback_for(name: str):
            def callback(options: CallbackOptions) -> list[Observation]:
                return [
                    Observation(s.value, s.series.label_map())
                    for s in store.samples() if s.name == name
                ]
            return callback

        def age_callback(options: CallbackOptions) -> list[Observation]:
            age = step_age(store)
            return [] if age is None else [Observation(age.value, age.series.label_map())]

        for spec in specs.values():
            names = [spec.name] if spec.type is not MetricType.SUMMARY else [
                f"{spec.name}_count", f"{spec.name}_sum"]
            for name in names:
                if spec.type is MetricType.GAUGE:
                    make = meter.create_observable_gauge
                else:
                    make = meter.create_observable_counter
                self._instruments.append(make(name, [callback_for(name)], description=spec.help))
        self._instruments.append(meter.create_observable_gauge(
            schema.RANK_STEP_AGE.name, [age_callback], description=schema.RANK_STEP_AGE.help))

    def flush(self, store: MetricStore) -> None:
        pass

    def close(self, store: MetricStore) -> None:
        pass


def make_sink(name: str, store: MetricStore, *, directory: str | None, port: int) -> Sink:
    """The sink called `name`; raises ValueError naming the choices for anything else."""
    if name == "multiprocess":
        if not directory:
            raise ValueError("backend 'multiprocess' needs a folder: set ROBUST_METRICS_DIR "
                             "or pass metrics_dir=")
        return MultiprocessSink(directory)
    if name == "http":
        return HttpSink(store, port)
    if name == "otel":
        return OtelSink(store)
    if name == "null":
        return NullSink()
    raise ValueError(f"unknown backend {name!r}: choose multiprocess, http, otel or null")

