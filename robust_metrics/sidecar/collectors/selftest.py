"""`selftest`: the node's last self-test report as series (`robust_selftest_*`).

The sidecar runs `robust-metrics selftest` as a subprocess on `POST /control/selftest` (the sidecar
never imports torch) and hands the report to this collector, which keeps the last one in memory:
a pass/fail gauge per check, each check's duration, the start time, and each check's figure in
its base unit. A check that was skipped publishes no verdict, so no rule reads "no GPU" as a
failed GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.selftest.api import Report
from robust_metrics.sidecar.collectors.registry import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = ["FIGURES", "SelftestCollector"]

# check -> the metric of its figure
FIGURES: dict[str, schema.MetricSpec] = {
    "compute": schema.SELFTEST_COMPUTE_FLOPS,
    "memory": schema.SELFTEST_MEMORY_BYTES,
    "communication": schema.SELFTEST_BUS_BANDWIDTH,
    "gpu": schema.SELFTEST_GPU_PROBLEMS,
}


class SelftestCollector:
    """Holds the last report; `publish` replaces it, `collect` renders it."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._report: Report | None = None

    def publish(self, report: Report) -> None:
        with self._lock:
            self._report = report

    @property
    def last(self) -> Report | None:
        with self._lock:
            return self._report

    def collect(self) -> Iterator[Metric]:
        report = self.last
        if report is None:
            return
        s = schema
        passed = GaugeMetricFamily(s.SELFTEST_PASSED.name, s.SELFTEST_PASSED.help,
                                   labels=["node", "check"])
        took = GaugeMetricFamily(s.SELFTEST_DURATION.name, s.SELFTEST_DURATION.help,
                                 labels=["node", "check"])
        last = GaugeMetricFamily(s.SELFTEST_LAST_RUN.name, s.SELFTEST_LAST_RUN.help,
                                 labels=["node"])
        figures = {check: GaugeMetricFamily(spec.name, spec.help, labels=["node"])
                   for check, spec in FIGURES.items()}
        last.add_metric([self.node], report.started)
        for result in report.results:
            took.add_metric([self.node, result.check], result.duration_seconds)
            if result.verdict == "skipped":
                continue
            passed.add_metric([self.node, result.check], 1.0 if result.passed else 0.0)
            if result.figure is not None and result.check in figures:
                figures[result.check].add_metric([self.node], float(result.figure))
        yield from (passed, took, last, *(f for f in figures.values() if f.samples))


@register_collector("selftest", default_enabled=True,
                    help="the node's last self-test (run by POST /control/selftest)")
def _factory(config: SidecarConfig, folder: RankFiles) -> SelftestCollector:
    return SelftestCollector(config.node)
