"""A real Alertmanager 0.25 delivers to the bridge: once per alert instance, resolved never acts.

Alertmanager (Debian `prometheus-alertmanager`) is started on loopback with a generated config
whose webhook receiver is the bridge (bearer token); alerts are injected with `amtool alert add`.
Short group and repeat intervals make Alertmanager re-send within seconds.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from robust_metrics.processes import alertmanager
from tests.bridge_fakes import Receiver, serve_app
from tests.support import require_binary, wait_until

TOKEN = "am-bridge-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Stack:
    def __init__(self, bridge: httpx.Client, am_url: str, amtool: str, hook: Receiver,
                 pager: Receiver) -> None:
        self.bridge, self.am_url, self.amtool, self.hook, self.pager = (
            bridge, am_url, amtool, hook, pager)

    def add(self, *labels: str, end: bool = False) -> None:
        cmd = [self.amtool, "alert", "add", f"--alertmanager.url={self.am_url}", *labels,
               "--annotation=summary=injected by test"]
        if end:
            cmd.append("--end=" + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        subprocess.run(cmd, check=True, timeout=20, capture_output=True)

    def incidents(self, run: str) -> list[dict[str, Any]]:
        r = self.bridge.get("/api/v1/actions", params={"run": run}, headers=AUTH)
        r.raise_for_status()
        return list(r.json()["actions"])

    def webhooks_ok(self) -> float:
        for line in self.bridge.get("/metrics").text.splitlines():
            if line.startswith('robust_bridge_webhook_requests_total{status="200"}'):
                return float(line.split()[-1])
        return 0.0

    def restarts(self, run: str) -> list[dict[str, Any]]:
        return [b for b in self.hook.bodies() if b["run"] == run]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_binary("prometheus-alertmanager", "alertmanager")
    amtool = require_binary("amtool")
    tmp = tmp_path_factory.mktemp("am")
    with Receiver(secret="s3cret") as hook, Receiver(secret="s3cret") as pager:
        raw = {
            "database": str(tmp / "bridge.db"), "auth": {"bearer_token": TOKEN}, "workers": 2,
            "schedulers": {"ops": {"type": "webhook", "url": hook.url, "secret": "s3cret"}},
            "notify": {"url": pager.url, "secret": "s3cret"},
            "restart_budget": {"max_restarts": 2, "window": "1h"},
            "rules": [
                {"name": "restart", "match": {"action": "restart"}, "actions": ["restart"]},
                {"name": "guarded", "match": {"alertname": "Guarded"}, "for": "30s",
                 "actions": ["notify"]},
            ],
        }
        with serve_app(create_app(Bridge(parse(raw, tmp)))) as bridge:
            config = {
                "route": {"receiver": "bridge", "group_by": ["alertname", "run"],
                          "group_wait": "1s", "group_interval": "1s", "repeat_interval": "2s"},
                "receivers": [{"name": "bridge", "webhook_configs": [{
                    "url": str(bridge.base_url.join("/api/v1/alerts")),
                    "send_resolved": True,
                    "http_config": {"authorization": {"type": "Bearer",
                                                      "credentials": TOKEN}}}]}],
            }
            with alertmanager(tmp / "am", config) as am:
                yield Stack(bridge, am.url, amtool, hook, pager)


def test_action_runs_once_despite_resends_and_grouping(stack: Stack) -> None:
    labels = ["alertname=RankHang", "run=r-once", "action=restart", "severity=critical"]
    stack.add(*labels, "rank=0")
    wait_until(lambda: stack.restarts("r-once"), 20, message="the restart to reach the scheduler")
    before = stack.webhooks_ok()
    stack.add(*labels, "rank=0")  # Prometheus re-sending the same alert
    # Alertmanager repeats the notification every 2s; let it do so a few times.
    wait_until(lambda: stack.webhooks_ok() >= before + 2, 20, message="Alertmanager re-sends")
    assert len(stack.restarts("r-once")) == 1
    stack.add(*labels, "rank=1")  # a second instance, grouped with the first by Alertmanager
    wait_until(lambda: len(stack.restarts("r-once")) == 2, 20, message="the grouped instance")
    resent = stack.webhooks_ok()
    wait_until(lambda: stack.webhooks_ok() >= resent + 2, 20, message="re-sends of the group")
    restarts = stack.restarts("r-once")
    assert len(restarts) == 2
    rows = stack.incidents("r-once")
    assert len(rows) == 2 and all(r["status"] == "done" for r in rows)
    assert max(r["notifications"] for r in rows) >= 3
    assert all(r["signed"] for r in stack.hook.requests)


def test_resolved_alert_never_acts(stack: Stack) -> None:
    labels = ["alertname=Guarded", "run=r-resolved", "severity=warning"]
    stack.add(*labels)
    rows = wait_until(lambda: stack.incidents("r-resolved"), 20, message="the firing alert")
    assert rows[0]["status"] == "pending"  # waiting for its 30s `for` guard
    stack.add(*labels, end=True)
    wait_until(lambda: stack.incidents("r-resolved")[0]["status"] == "cancelled", 20,
               message="the resolution to cancel the pending action")
    assert [b for b in stack.pager.bodies() if b["run"] == "r-resolved"] == []


def test_restart_budget_holds(stack: Stack) -> None:
    for rank in range(4):
        stack.add("alertname=RankHang", "run=r-budget", "action=restart", f"rank={rank}")
    final = {"done", "failed"}
    rows = wait_until(lambda: len(r := stack.incidents("r-budget")) == 4 and all(
        i["status"] in final for i in r) and r, 30, message="four settled incidents")
    assert len(stack.restarts("r-budget")) == 2
    escalated = [b for b in stack.pager.bodies() if b["run"] == "r-budget"]
    assert len(escalated) == 2 and all(b["escalated_from"] == "restart" for b in escalated)
    assert sorted(r["steps"][0]["action"] for r in rows) == ["notify", "notify", "restart",
                                                              "restart"]
