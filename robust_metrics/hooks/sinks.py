"""Where a rank's metrics go, chosen by name: `multiprocess`, `http`, `otel`, or `null`.

- `multiprocess` writes prometheus_client's multiprocess files into `ROBUST_METRICS_DIR`, the
  format the node sidecar (and any `MultiProcessCollector`) reads. A rank that hangs keeps its last
  written values on disk, so the sidecar still serves them.
- `http` serves `/metrics` from this process (no sidecar: a laptop, one pod per rank).
- `otel` exports the same names through the OpenTelemetry SDK's global meter provider.
- `null` publishes nothing (tests, benchmarks).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from robust_metrics.hooks.store import MetricStore, Series
from robust_metrics.schema import MetricType

__all__ = ["HttpSink", "MultiprocessSink", "NullSink", "OtelSink", "Sink", "make_sink"]

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


def _file_prefix(spec_type: MetricType, gauge_mode: str) -> str:
    if spec_type is MetricType.GAUGE:
        return f"gauge_{gauge_mode}"
    return str(spec_type)


class MultiprocessSink:
    """Writes prometheus_client multiprocess `.db` files, one per metric type, named by pid."""

    def __init__(self, directory: str, pid: int | None = None) -> None:
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self._mmap_dict = MmapedDict
        self._mmap_key = mmap_key
        self._files: dict[str, Any] = {}
        self._keys: dict[tuple[int, str], tuple[Any, str]] = {}

    def _slot(self, series: Series, name: str) -> tuple[Any, str]:
        key = (id(series), name)
        slot = self._keys.get(key)
        if slot is None:
            spec = series.spec
            prefix = _file_prefix(spec.type, spec.gauge_mode)
            mmap_file = self._files.get(prefix)
            if mmap_file is None:
                path = os.path.join(self.directory, f"{prefix}_{self.pid}.db")
                mmap_file = self._files[prefix] = self._mmap_dict(path)
            key_text = self._mmap_key(
                spec.base_name, name, list(spec.labels), list(series.labels), spec.help
            )
            slot = self._keys[key] = (mmap_file, key_text)
        return slot

    def flush(self, store: MetricStore) -> None:
        for sample in store.samples():
            mmap_file, key_text = self._slot(sample.series, sample.name)
            timestamp = sample.series.updated if sample.series.spec.type is MetricType.GAUGE else 0.0
            mmap_file.write_value(key_text, sample.value, timestamp)

    def close(self, store: MetricStore) -> None:
        self.flush(store)
        for mmap_file in self._files.values():
            mmap_file.close()
        self._files.clear()
        self._keys.clear()


class HttpSink:
    """Serves the store on `/metrics` from a daemon thread of this process."""

    def __init__(self, store: MetricStore, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(store)  # type: ignore[arg-type]
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
        from robust_metrics import schema

        for spec in schema.all_metrics(schema.Source.RANK):
            specs.setdefault(spec.name, spec)

        def callback_for(name: str):
            def callback(options: CallbackOptions) -> list[Observation]:
                return [
                    Observation(s.value, dict(zip(s.series.spec.labels, s.series.labels,
                                                  strict=True)))
                    for s in store.samples() if s.name == name
                ]
            return callback

        for spec in specs.values():
            names = [spec.name] if spec.type is not MetricType.SUMMARY else [
                f"{spec.name}_count", f"{spec.name}_sum"]
            for name in names:
                if spec.type is MetricType.GAUGE:
                    make = meter.create_observable_gauge
                else:
                    make = meter.create_observable_counter
                self._instruments.append(make(name, [callback_for(name)], description=spec.help))

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

