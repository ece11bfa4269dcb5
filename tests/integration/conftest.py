"""Fixtures shared by the end-to-end tests; a module's own fixture of the same name wins."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_alerts_e2e import write_test_rules
from tests.prometheus_fixture import PrometheusServer
from tests.support import SidecarProcess, require_binary


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real `robust-metrics sidecar` (node `node-a`) serving a rank folder, scraped by a real
    Prometheus that evaluates the shipped rules every second, time-scaled by 1/15; one per
    module: {"prom", "folder", "metrics", "sidecar"}."""
    require_binary("prometheus")
    folder = tmp_path_factory.mktemp("sidecar-e2e")
    metrics = folder / "metrics"
    metrics.mkdir()
    with SidecarProcess(metrics, ["--node", "node-a"], log_path=folder / "sidecar.log") as sidecar:
        server = PrometheusServer(folder / "prometheus", [sidecar.url.removeprefix("http://")],
                                  rule_files=[write_test_rules(folder)])
        server.start()
        try:
            yield {"prom": server, "folder": folder, "metrics": metrics, "sidecar": sidecar}
        finally:
            server.stop()
