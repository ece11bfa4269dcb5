"""The alert rules end to end on the VictoriaMetrics backend: the same two tests as
tests/integration/test_alerts_e2e.py (a healthy run stays silent, then a stopped rank is named by
RankHang; a slow rank and a NaN loss are named by SlowRank and NonFiniteLoss), with the deployed
chain in place of Prometheus: two vmagent shards scrape the ranks every second and remote-write to
VictoriaMetrics, vmalert evaluates the same 1/15-scaled rules every second and notifies a real
Alertmanager. The tests read the firing alerts from vmalert's Prometheus-compatible alerts API.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration import test_alerts_e2e as e2e
from tests.integration.test_alerts_e2e import (  # noqa: F401 (collected here, with this setup)
    test_healthy_run_is_silent_then_a_stopped_rank_is_named,
    test_slow_rank_and_nan_loss_are_named,
)
from tests.support import free_port_block
from tests.victoriametrics_fixture import VictoriaMetricsServer, VMAgent, VMAlert, alertmanager_service

pytestmark = pytest.mark.integration
SHARDS = 2


class Backend:
    """What the shared tests use of Prometheus: queries go to VictoriaMetrics, `api("alerts")`
    to vmalert."""

    def __init__(self, vm: VictoriaMetricsServer, vmalert: VMAlert) -> None:
        self.vm, self.vmalert = vm, vmalert

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return self.vm.query(expr, at)

    def api(self, path: str, **params: Any) -> Any:
        data = self.vmalert.api(path, **params)
        if path == "alerts" and data.get("alerts") is None:  # vmalert's answer when none is active
            data["alerts"] = []
        return data


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("e2e-vm")
    ports = {"healthy": free_port_block(e2e.WORLD), "faulty": free_port_block(e2e.WORLD)}
    targets = [f"127.0.0.1:{base + r}" for base in ports.values() for r in range(e2e.WORLD)]
    rules_file = e2e.write_test_rules(folder)
    with VictoriaMetricsServer(folder / "vm") as vm, \
            VMAgent(folder / "vmagent0", vm, targets, members=SHARDS, member=0), \
            VMAgent(folder / "vmagent1", vm, targets, members=SHARDS, member=1), \
            alertmanager_service(folder / "alertmanager") as alertmanager, \
            VMAlert(folder / "vmalert", vm, rule_files=[rules_file], notifier_url=alertmanager,
                    # recorded series reach storage within 0.2 s, as rules chain every second
                    extra_args=["-remoteWrite.flushInterval=200ms"]) as vmalert:
        yield {"prom": Backend(vm, vmalert), "ports": ports, "folder": folder}
