"""A node named in 3 incidents is flagged and drained, on real parts: the bridge (in this
process, over HTTP) enters three NIC incidents of three runs on node n7 in its ledger; a real
Prometheus scrapes the bridge's `robust_bridge_node_incidents` and evaluates
`alert_rules/nodes.yml`; SuspectNode goes through a real Alertmanager back to the bridge, which
drains n7 through the webhook scheduler (a recording receiver at the scheduler boundary). After
two incidents nothing fires; a node named twice (n8) is never drained. Prometheus also scrapes a
stand-in for four node sidecars (their collector series), the nodes SuspectNode compares with."""

from __future__ import annotations

import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from robust_metrics.processes import alertmanager
from robust_metrics.rules import RULES_DIR
from tests.bridge_fakes import Receiver, StubServer, alert, send_reply, serve_app, webhook
from tests.prometheus_fixture import PrometheusServer
from tests.support import require_binary, wait_until

TOKEN = "suspect-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SIDECARS = ("n7", "n8", "n9", "n10")


class _SidecarMetrics(BaseHTTPRequestHandler):
    """What every node sidecar serves whatever else it does: its collectors' success."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        send_reply(self, 200, b'robust_sidecar_collector_success{collector="ranks"} 1\n',
                   "text/plain")


def test_node_named_in_three_incidents_is_flagged_and_drained(tmp_path: Path) -> None:
    require_binary("prometheus-alertmanager", "alertmanager")
    with Receiver(secret="s3cret") as ops, Receiver(secret="s3cret") as pager, \
            StubServer(_SidecarMetrics) as sidecars:
        raw = {
            "database": str(tmp_path / "bridge.db"), "auth": {"bearer_token": TOKEN},
            "schedulers": {"ops": {"type": "webhook", "url": ops.url, "secret": "s3cret"}},
            "notify": {"url": pager.url, "secret": "s3cret"},
            "incidents": {"poll": "0.5s"},
            "rules": [
                {"name": "flap", "match": {"alertname": "NICFlapping"}, "actions": ["notify"]},
                {"name": "suspect", "match": {"action": "drain_node"}, "scheduler": "ops",
                 "actions": ["drain_node"]},
            ],
        }
        with serve_app(create_app(Bridge(parse(raw, tmp_path)))) as bridge:
            am_config = {
                "route": {"receiver": "bridge", "group_by": ["alertname", "node"],
                          "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
                "receivers": [{"name": "bridge", "webhook_configs": [{
                    "url": str(bridge.base_url.join("/api/v1/alerts")),
                    "http_config": {"authorization": {"type": "Bearer",
                                                      "credentials": TOKEN}}}]}],
            }
            with alertmanager(tmp_path / "am", am_config) as am:
                target = str(bridge.base_url).removeprefix("http://").rstrip("/")
                prom_config = {
                    "global": {"scrape_interval": "500ms", "scrape_timeout": "500ms",
                               "evaluation_interval": "500ms"},
                    "rule_files": [str((RULES_DIR / "nodes.yml").resolve())],
                    "alerting": {"alertmanagers": [{"static_configs": [
                        {"targets": [am.url.removeprefix("http://")]}]}]},
                    "scrape_configs": [
                        {"job_name": "bridge", "static_configs": [{"targets": [target]}]},
                        {"job_name": "sidecars", "static_configs": [
                            {"targets": [f"127.0.0.1:{sidecars.port}"],
                             "labels": {"instance": node}} for node in SIDECARS]}],
                }
                with PrometheusServer(tmp_path / "prom", config=prom_config) as prom:
                    _run(bridge, prom, ops)


def _incident(bridge: httpx.Client, n: int, node: str) -> None:
    r = bridge.post("/api/v1/alerts", headers=AUTH, json=webhook(alert(
        "NICFlapping", fingerprint=f"flap{n}-{node}", run=f"run{n}", node=node,
        action="checkpoint")))
    assert r.status_code == 200, r.text


def _score(prom: PrometheusServer, node: str) -> float | None:
    result = prom.query(f'robust_bridge_node_incidents{{node="{node}"}}')
    return float(result[0]["value"][1]) if result else None


def _run(bridge: httpx.Client, prom: PrometheusServer, ops: Receiver) -> None:
    for n in (1, 2):
        _incident(bridge, n, "n7")
        _incident(bridge, n, "n8")
    wait_until(lambda: _score(prom, "n7") == 2 and _score(prom, "n8") == 2, 60, 0.5,
               message="Prometheus to scrape a score of 2 for n7 and n8")
    wait_until(lambda: len(prom.query("count by (instance) (robust_sidecar_collector_success)"))
               == len(SIDECARS), 30, 0.5, message="Prometheus to scrape the four sidecars")
    time.sleep(3)  # several rule evaluations at a score of 2
    assert not prom.query('ALERTS{alertname="SuspectNode"}')
    assert ops.bodies() == []
    _incident(bridge, 3, "n7")
    drains = wait_until(lambda: [b for b in ops.bodies() if b["operation"] == "drain_node"],
                        60, 0.5, message="the bridge to drain n7\n" + prom.logs())
    assert [d["node"] for d in drains] == ["n7"]
    assert _score(prom, "n7") == 3 and _score(prom, "n8") == 2
    rows = bridge.get("/api/v1/actions", headers=AUTH).json()["actions"]
    suspect = [r for r in rows if r["alertname"] == "SuspectNode"]
    assert len(suspect) == 1 and suspect[0]["labels"]["node"] == "n7"
    # the drain's own incident is entered but does not raise n7's score
    wait_until(lambda: any(e["alertname"] == "SuspectNode" for e in bridge.get(
        "/api/v1/incidents", headers=AUTH).json()["incidents"]), 30, 0.5,
        message="the ledger to enter the SuspectNode incident")
    time.sleep(2)
    assert _score(prom, "n7") == 3
    nodes = bridge.get("/api/v1/nodes", headers=AUTH).json()["nodes"]
    assert nodes == [{"node": "n7", "incidents": 3}, {"node": "n8", "incidents": 2}]
