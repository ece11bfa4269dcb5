"""The collector interface, the registry of collectors, and the scrape that runs them.

As in node_exporter, every collector lives in its own module of this package and registers itself
with a name and whether it is on by default (`register_collector`); the registry makes the
`--collector.NAME` / `--no-collector.NAME` flags and wraps each collector so its duration and
success are series of their own (`robust_sidecar_collector_duration_seconds{collector}`,
`robust_sidecar_collector_success`). A collector that raises loses its own series for that scrape,
never the scrape.

This module imports no collector: the package's `__init__` imports every collector module, and
Python runs it before any of its modules, this one included, can be imported from outside. So
`available()` is complete without importing anything itself, and no import runs in a circle.
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = [
    "Collector",
    "CollectorInfo",
    "ScrapeRegistry",
    "add_collector_flags",
    "available",
    "enabled_names",
    "register_collector",
]

log = logging.getLogger(__name__)


class Collector(Protocol):
    """What every collector implements: one scrape's metric families."""

    def collect(self) -> Iterable[Metric]: ...


Factory = Callable[[SidecarConfig, RankFiles], Collector]


@dataclass(frozen=True)
class CollectorInfo:
    """A registered collector: the name of its flag, whether it is on without one, the flag's
    help, and the factory the sidecar calls once at start-up for each enabled collector."""

    name: str
    default_enabled: bool
    help: str
    factory: Factory


_COLLECTORS: dict[str, CollectorInfo] = {}


def register_collector(name: str, *, default_enabled: bool, help: str) -> Callable[[Factory], Factory]:
    """Decorator for a collector factory `(config, folder) -> Collector`."""

    def decorate(factory: Factory) -> Factory:
        if name in _COLLECTORS:
            raise ValueError(f"collector {name!r} registered twice")
        _COLLECTORS[name] = CollectorInfo(name, default_enabled, help, factory)
        return factory

    return decorate


def available() -> dict[str, CollectorInfo]:
    """Every registered collector: all of them, since the package imported each one before this
    module could be imported from outside it."""
    return dict(_COLLECTORS)


def add_collector_flags(parser: argparse.ArgumentParser) -> None:
    """`--collector.NAME` / `--no-collector.NAME` for every registered collector."""
    group = parser.add_argument_group("collectors")
    for info in available().values():
        state = "on" if info.default_enabled else "off"
        group.add_argument(f"--collector.{info.name}", dest=f"collector_{info.name}",
                           action=argparse.BooleanOptionalAction, default=None,
                           help=f"{info.help} (default: {state})")


def enabled_names(args: argparse.Namespace) -> list[str]:
    """Names of the collectors the parsed flags turn on."""
    names = []
    for info in available().values():
        flag = getattr(args, f"collector_{info.name}", None)
        if (info.default_enabled if flag is None else flag):
            names.append(info.name)
    return names


class ScrapeRegistry:
    """Runs the enabled collectors for one scrape; a prometheus_client-compatible collector.

    Collectors run concurrently (NVML calls, sysfs and /proc reads release the GIL) under one
    deadline, `timeout` seconds: a collector that has not answered by then, such as an NVML call
    stuck on a GPU in a bad state, is reported as failed for that scrape and the others are
    served. A collector runs at most once at a time: a scrape that finds it still running (a
    concurrent scrape, or a hung call) waits for that run instead of starting another, so hung
    calls never pile up threads and concurrent scrapes share one collection.
    """

    def __init__(self, collectors: dict[str, Collector], timeout: float = 5.0,
                 node: str = "") -> None:
        self.collectors = dict(collectors)
        self.timeout = timeout
        # The node's name on the collectors' own series: SidecarDown names the node whose
        # sidecar stopped answering from them.
        self.node = node
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.collectors)),
                                        thread_name_prefix="robust-metrics-collector")
        self._inflight: dict[str, tuple[float, Future[tuple[list[Metric], float]]]] = {}

    @staticmethod
    def _run(collector: Collector) -> tuple[list[Metric], float]:
        started = time.perf_counter()
        produced = list(collector.collect())
        return produced, time.perf_counter() - started

    def _submit(self, name: str) -> tuple[float, Future[tuple[list[Metric], float]]]:
        with self._lock:
            running = self._inflight.get(name)
            if running is None or running[1].done():
                running = (time.perf_counter(),  # in the scrape's context: its pinned state
                           self._pool.submit(contextvars.copy_context().run, self._run,
                                             self.collectors[name]))
                self._inflight[name] = running
            return running

    def collect(self) -> Iterator[Metric]:
        duration = GaugeMetricFamily(schema.COLLECTOR_DURATION.name,
                                     schema.COLLECTOR_DURATION.help, labels=["node", "collector"])
        success = GaugeMetricFamily(schema.COLLECTOR_SUCCESS.name,
                                    schema.COLLECTOR_SUCCESS.help, labels=["node", "collector"])
        runs = {name: self._submit(name) for name in self.collectors}
        deadline = time.monotonic() + self.timeout
        families: dict[str, Metric] = {}
        for name, (started, future) in runs.items():
            try:
                produced, took = future.result(timeout=max(0.0, deadline - time.monotonic()))
                ok = True
            except FutureTimeout:
                produced, ok, took = [], False, time.perf_counter() - started
                self._log_once(name, TimeoutError(f"no answer after {took:.1f}s"))
            except Exception as exc:  # a broken collector costs its own series only
                produced, ok, took = [], False, time.perf_counter() - started
                self._log_once(name, exc)
            duration.add_metric([self.node, name], took)
            success.add_metric([self.node, name], 1.0 if ok else 0.0)
            for family in produced:
                known = families.get(family.name)
                if known is None:
                    families[family.name] = family
                else:  # two collectors contribute to one family: merge into a new object,
                    # never into theirs (collectors may hand out shared, cached families)
                    merged = Metric(known.name, known.documentation, known.type)
                    merged.samples = [*known.samples, *family.samples]
                    families[family.name] = merged
        yield from families.values()
        yield duration
        yield success

    def close(self) -> None:
        """Stop the worker threads (a hung collector's thread is left to die with the process)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _log_once(self, name: str, exc: Exception) -> None:
        with self._lock:
            first = name not in self._logged
            self._logged.add(name)
        if first:
            log.error("collector %s failed (logged once): %s", name, exc, exc_info=exc)
        else:
            log.debug("collector %s failed: %s", name, exc)
