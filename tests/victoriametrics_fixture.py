"""Real VictoriaMetrics (Debian 1.79) for integration tests: the single-node server, vmalert and
vmagent, the second backend next to Prometheus (tests/prometheus_fixture.py).

    with VictoriaMetricsServer(tmp_path, targets=["127.0.0.1:9741"]) as vm, \\
            VMAlert(tmp_path / "vmalert", vm, rule_files=[...], notifier_url=am_url) as vmalert:
        vm.query('up')
        vmalert.api("alerts")

The processes are the harness's (`robust_metrics.processes.VictoriaMetrics`, `VMAlert`,
`VMAgent`: free loopback ports, data under the test's temporary folder, their own sessions,
terminated then killed on exit). Here they only skip the test where the package is missing
(`require_binary`) and fail it with their log when they do not start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from robust_metrics import processes
from robust_metrics.processes import ServiceError, alertmanager, scrape_config
from tests.support import require_binary

__all__ = ["VMAgent", "VMAlert", "VictoriaMetricsServer", "alertmanager_service",
           "scrape_config"]


class _FailsTheTest:
    """Start failures fail the test with the service's log (an AssertionError)."""

    def start(self, timeout: float = 30) -> Any:
        try:
            return super().start(timeout)  # type: ignore[misc]
        except ServiceError as exc:
            raise AssertionError(str(exc)) from None


class VictoriaMetricsServer(_FailsTheTest, processes.VictoriaMetrics):
    def __init__(self, workdir: Path, targets: Sequence[str] = (), **kwargs: Any) -> None:
        require_binary("victoria-metrics")
        super().__init__(workdir, targets, **kwargs)


class VMAlert(_FailsTheTest, processes.VMAlert):
    def __init__(self, workdir: Path, datasource: processes.VictoriaMetrics,
                 **kwargs: Any) -> None:
        require_binary("vmalert")
        super().__init__(workdir, datasource, **kwargs)


class VMAgent(_FailsTheTest, processes.VMAgent):
    def __init__(self, workdir: Path, destination: processes.VictoriaMetrics,
                 targets: Sequence[str] = (), **kwargs: Any) -> None:
        require_binary("vmagent")
        super().__init__(workdir, destination, targets, **kwargs)


@contextlib.contextmanager
def alertmanager_service(workdir: Path, config: dict[str, Any] | None = None
                         ) -> Iterator[str]:
    """A real Alertmanager on a free loopback port (no receiver by default); yields its URL."""
    require_binary("prometheus-alertmanager", "alertmanager")
    config = config or {"route": {"receiver": "null"}, "receivers": [{"name": "null"}]}
    service = alertmanager(Path(workdir), config)
    try:
        service.start(timeout=30)
    except ServiceError as exc:
        raise AssertionError(str(exc)) from None
    try:
        yield service.url
    finally:
        service.stop(timeout=15)
