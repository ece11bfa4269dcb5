"""The alert rules end to end on the VictoriaMetrics backend, with the deployed chain in place of
Prometheus: vmagent scrapes every second and remote-writes to VictoriaMetrics, vmalert evaluates
the same 1/15-scaled rules every second and notifies a real Alertmanager. The tests read the
firing alerts from vmalert's Prometheus-compatible alerts API.

- a slow rank and a NaN loss are named by SlowRank and NonFiniteLoss: the test of
  tests/integration/test_alerts_e2e.py, ranks serving their own /metrics, two vmagent shards;
- a healthy run stays silent, then a rank stopped inside the all-reduce its peers wait in is
  named by RankHang: ranks behind the node sidecar, as deployed.

The stopped rank runs behind the sidecar here, not with its own /metrics as in
test_alerts_e2e.py: VictoriaMetrics makes a series that is new to it searchable about 10 s after
its first sample, and the hang rules chain three records that exist only while a run hangs. A
rank that serves its own /metrics vanishes when stopped, and RankHang reads its last counters
from a 5 minute window, 20 s at this time scale: 30 s of new-series delay outlast it (at the
default 15 s intervals they take 30 s of 5 minutes). Behind the sidecar a stopped rank's
series stay, and the chain only delays the alert. docs/victoriametrics.md says so.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration import alert_checks as checks
from tests.support import SidecarProcess, free_port_block
from tests.victoriametrics_fixture import VictoriaMetricsServer, VMAgent, VMAlert, alertmanager_service

SHARDS = 2
# Scraped samples reach storage within 0.1 s (vmagent's default is 1 s) and recorded series
# within 0.2 s, as rules chain every second.
FAST_WRITE = ["-remoteWrite.flushInterval=100ms"]
RECORDS_WRITE = ["-remoteWrite.flushInterval=200ms"]


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
    ports = {"faulty": free_port_block(checks.WORLD)}
    targets = [f"127.0.0.1:{base + r}" for base in ports.values() for r in range(checks.WORLD)]
    rules_file = checks.write_test_rules(folder)
    with VictoriaMetricsServer(folder / "vm") as vm, \
            VMAgent(folder / "vmagent0", vm, targets, members=SHARDS, member=0,
                    extra_args=FAST_WRITE), \
            VMAgent(folder / "vmagent1", vm, targets, members=SHARDS, member=1,
                    extra_args=FAST_WRITE), \
            alertmanager_service(folder / "alertmanager") as alertmanager, \
            VMAlert(folder / "vmalert", vm, rule_files=[rules_file], notifier_url=alertmanager,
                    extra_args=RECORDS_WRITE) as vmalert:
        yield {"prom": Backend(vm, vmalert), "ports": ports, "folder": folder}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Ranks writing a multiprocess folder, the node sidecar serving it, scraped by vmagent."""
    folder = tmp_path_factory.mktemp("e2e-vm-sidecar")
    metrics = folder / "metrics"
    metrics.mkdir()
    rules_file = checks.write_test_rules(folder)
    with SidecarProcess(metrics, ["--node", "node-a"], log_path=folder / "sidecar.log") as side, \
            VictoriaMetricsServer(folder / "vm") as vm, \
            VMAgent(folder / "vmagent", vm, [side.url.removeprefix("http://")],
                    extra_args=FAST_WRITE), \
            alertmanager_service(folder / "alertmanager") as alertmanager, \
            VMAlert(folder / "vmalert", vm, rule_files=[rules_file], notifier_url=alertmanager,
                    extra_args=RECORDS_WRITE) as vmalert:
        yield {"prom": Backend(vm, vmalert), "folder": folder, "metrics": metrics}


def test_slow_rank_and_nan_loss_are_named(setup: dict[str, Any]) -> None:
    """tests/integration/test_alerts_e2e.py's test, on this module's `setup`."""
    checks.slow_rank_and_nan_loss_are_named(setup)


def test_healthy_run_is_silent_then_a_stopped_rank_is_named(stack: dict[str, Any]) -> None:
    prom, run, stopped = stack["prom"], "stopped", 3
    with checks.start_sidecar_job(stack, run,
                                  ["--stop-rank", str(stopped), "--stop-step", "800"]) as job:
        checks.wait_steps(prom, run, job, steps=5)
        # the healthy stretch before the stop: ~40 s, 10 minutes of production time
        recorded = False
        while max(float(r["value"][1]) for r in prom.query(
                f'robust_global_step{{run="{run}"}}')) < 780:
            problems = checks.unexplained(prom, run)
            assert not problems, "a healthy run raised:\n" + "\n".join(problems) + "\n" + job.logs()
            recorded = recorded or bool(prom.query(
                f'run:robust_step_duration_seconds:median5m{{run="{run}"}}'))
            time.sleep(1)
        assert recorded, "the step-time recording rules produced nothing: the silence proves nothing"
        try:
            t0 = time.monotonic()
            rank_hang = checks.wait_firing(prom, run, "RankHang", 90, job)
            hang = checks.wait_firing(prom, run, "TrainingHang", 10, job)
            print(f"\nrank {stopped} stopped in the all-reduce: RankHang after "
                  f"{time.monotonic() - t0:.1f}s on VictoriaMetrics")
            assert hang["labels"]["action"] == "dump_stacks"
            assert rank_hang["labels"]["rank"] == str(stopped), rank_hang
            assert rank_hang["labels"]["node"] == "node-a", rank_hang
            assert rank_hang["labels"]["action"] == "restart"
            time.sleep(2)
            named = {a["labels"].get("rank") for a in checks.alerts(prom, run)
                     if a["labels"]["alertname"] == "RankHang"}
            assert named == {str(stopped)}, named
        finally:
            os.kill(job.pids[stopped], signal.SIGCONT)
