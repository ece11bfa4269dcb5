"""The integration tests: every test collected under this folder is marked `integration`, so the
folder decides which pass runs a test (`make test`'s second pass, `-m integration`); a module
here names no marker of its own. Also the fixtures they share; a module's own fixture of the same
name wins."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.alert_checks import TIME_SCALE, write_test_rules
from tests.prometheus_fixture import PrometheusServer
from tests.support import SidecarProcess, require_binary

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test that lives under tests/integration/ (the hook sees the whole session's
    items, so it checks each item's path, resolved as this folder's is)."""
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def ranks_at_the_rules_time_scale() -> Iterator[None]:
    """Every rank these tests start keeps its step windows at the time scale of the rules
    that judge it (1/15, `robust-metrics rules --time-scale`): the hook's 1-minute window is 4 s,
    as the rules' `[1m]` is."""
    before = os.environ.get("ROBUST_METRICS_TIME_SCALE")
    os.environ["ROBUST_METRICS_TIME_SCALE"] = repr(TIME_SCALE)
    yield
    if before is None:
        del os.environ["ROBUST_METRICS_TIME_SCALE"]
    else:
        os.environ["ROBUST_METRICS_TIME_SCALE"] = before


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
