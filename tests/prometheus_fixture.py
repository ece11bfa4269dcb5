"""A real Prometheus (Debian 2.42) for integration tests: scrape targets, rule files, query API.

    with PrometheusServer(tmp_path, targets=["127.0.0.1:9741"], rule_files=[...]) as prom:
        prom.wait_for_targets_up(1)
        prom.query('up')

The process is the harness's (robust_metrics.processes): storage under the test's temporary
folder, its own session, terminated (then its group killed) on exit. `require_binary` skips the
test where Prometheus is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from robust_metrics.processes import Prometheus, QueryAPI
from tests.support import require_binary, wait_until

__all__ = ["PrometheusServer", "QueryAPI", "prometheus_factory", "prometheus_server",
           "wait_for_series"]


class PrometheusServer(Prometheus):
    """The harness's Prometheus (`robust_metrics.processes.Prometheus`); skips the test where
    the binary is missing."""

    def __init__(self, workdir: Path, targets: Sequence[str] = (), **kwargs: Any) -> None:
        require_binary("prometheus")
        super().__init__(workdir, targets, **kwargs)

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        super().start(timeout)
        return self

    def __enter__(self) -> PrometheusServer:
        return self.start()


@contextlib.contextmanager
def prometheus_server(workdir: Path, targets: Sequence[str] = (), **kwargs: Any
                      ) -> Iterator[PrometheusServer]:
    """Context manager form, for fixtures: `with prometheus_server(tmp, [...]) as prom:`."""
    server = PrometheusServer(workdir, targets, **kwargs)
    try:
        yield server.start()
    finally:
        server.stop()


def wait_for_series(prom: PrometheusServer, expr: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Poll an instant query until it returns at least one series."""
    return wait_until(lambda: prom.query(expr), timeout=timeout, interval=0.5,
                      message=f"data for {expr}")


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Any]:
    """Call it with (targets, **kwargs) to start Prometheus; every one started is stopped."""
    started: list[PrometheusServer] = []

    def start(targets: Sequence[str] = (), **kwargs: Any) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus{len(started)}", targets, **kwargs)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()

