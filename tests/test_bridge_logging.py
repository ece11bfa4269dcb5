"""What the bridge logs: what it decided and did at INFO, routine Prometheus polls at DEBUG only,
and, once, a warning when a restart waits for a stop notice that no scrape will deliver."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from robust_metrics.bridge.cli import configure_logging
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.payload import parse_notification
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import StubServer, alert, send_reply, webhook
from tests.support import wait_until

TOKEN = "t"
NOTICE = "robust_bridge_run_stop_timestamp_seconds"


class _PrometheusHandler(BaseHTTPRequestHandler):
    """Answers instant queries with nothing (the notice is never stored) and the target metadata
    API with what the test set: the targets that expose a metric, or no such API (404)."""

    def do_GET(self) -> None:
        owner: FakePrometheus = self.server.owner  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        with owner.lock:
            owner.paths.append(url.path)
        if url.path == "/api/v1/query":
            send_reply(self, 200, {"status": "success",
                                   "data": {"resultType": "vector", "result": []}})
        elif url.path == "/api/v1/targets/metadata" and owner.metadata is not None:
            metric = parse_qs(url.query).get("metric", [""])[0]
            send_reply(self, 200, {"status": "success", "data": [
                {"target": {"job": "bridge", "instance": "b:9095"}, "type": "gauge",
                 "help": "h", "unit": ""}] if metric in owner.metadata else []})
        else:
            send_reply(self, 404, {"status": "error", "error": "not found"})

    def log_message(self, *args: Any) -> None:
        pass


class FakePrometheus(StubServer):
    def __init__(self, metadata: set[str] | None) -> None:
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.metadata = metadata  # metrics some target exposes; None: no metadata API
        super().__init__(_PrometheusHandler)


def _config(tmp_path: Path, prometheus: str, notice_timeout_s: float = 0.5) -> Any:
    return parse({
        "database": "bridge.db", "auth": {"bearer_token": TOKEN},
        "prometheus": {"url": prometheus},
        "schedulers": {"local": {"type": "local", "command": ["true"], "state_dir": "state"}},
        "incidents": {"crash_loop_restarts": 0},
        "rules": [{"name": "restart", "match": {"action": "restart"},
                   "actions": [{"type": "restart", "notice_timeout_s": notice_timeout_s}]}]},
        tmp_path)


@pytest.fixture
def bridge_with(tmp_path: Path) -> Iterator[Any]:
    bridges: list[Bridge] = []

    def make(prometheus: FakePrometheus) -> Bridge:
        bridge = Bridge(_config(tmp_path / str(len(bridges)), prometheus.url))
        bridges.append(bridge)
        bridge.start()
        return bridge

    (tmp_path / "0").mkdir()
    (tmp_path / "1").mkdir()
    yield make
    for bridge in bridges:
        bridge.close()


def _restart(bridge: Bridge, fingerprint: str, run: str = "r1") -> dict[str, Any]:
    """Start the run, send one restart alert for it and wait for the restart step; returns the
    step's data."""
    assert bridge.schedulers["local"].start(run).ok  # type: ignore[attr-defined]
    bridge.handle(parse_notification(webhook(alert("RankHang", fingerprint=fingerprint,
                                                   run=run, action="restart"))))

    def finished() -> Any:
        rows = [i for i, _ in bridge.store.list(run=run) if i.fingerprint == fingerprint]
        return rows and rows[0].status in ("done", "failed") and bridge.store.steps(rows[0].id)

    steps = wait_until(finished, 20, message="the restart step to finish")
    return dict(steps[0].data) | {"detail": steps[0].detail}


def test_polls_are_debug_and_step_outcomes_info(bridge_with: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    configure_logging("info")
    caplog.set_level(logging.INFO)
    with FakePrometheus({NOTICE}) as prometheus:
        bridge = bridge_with(prometheus)
        _restart(bridge, "f1")
        for _ in range(3):
            bridge.ledger.step()
        assert prometheus.paths.count("/api/v1/query") >= 2  # it did poll
        assert not [r for r in caplog.records if r.name.startswith("httpx")], [
            r.getMessage() for r in caplog.records]
        outcomes = [r for r in caplog.records
                    if r.name == "robust_metrics.bridge.engine" and "step 0 restart" in
                    r.getMessage()]
        assert [r.levelno for r in outcomes] == [logging.INFO]  # what changed stays visible

        caplog.clear()
        caplog.set_level(logging.DEBUG)
        bridge.ledger.step()
        bridge.prometheus.query("up")
        polls = [r for r in caplog.records if r.name == "httpx"]
        assert polls and {r.levelno for r in polls} == {logging.DEBUG}
        assert "HTTP Request: GET" in polls[-1].getMessage()


def test_a_restart_that_no_scrape_can_announce_warns_once(bridge_with: Any,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    caplog.set_level(logging.INFO)
    with FakePrometheus(set()) as prometheus:  # Prometheus scrapes nothing that is the bridge
        bridge = bridge_with(prometheus)
        first = _restart(bridge, "f1")
        second = _restart(bridge, "f2", run="r2")
    for data in (first, second):
        assert "not seen by Prometheus within 0.5 s; stopped anyway" in data["stop_notice"]
        assert f"no target of Prometheus exposes {NOTICE}" in data["stop_notice"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "robust_metrics.bridge.actions"]
    assert len(warnings) == 1, warnings
    assert "waits 0.5 s (notice_timeout_s)" in warnings[0]
    assert "add the bridge's /metrics (http://127.0.0.1:9095/metrics" in warnings[0]
    assert "scrape_configs" in warnings[0] and prometheus.url in warnings[0]


@pytest.mark.parametrize("metadata", [{NOTICE}, None], ids=["scraped", "no-metadata-api"])
def test_no_warning_when_the_bridge_is_scraped_or_prometheus_cannot_tell(
        bridge_with: Any, caplog: pytest.LogCaptureFixture, metadata: set[str] | None) -> None:
    caplog.set_level(logging.INFO)
    with FakePrometheus(metadata) as prometheus:
        bridge = bridge_with(prometheus)
        data = _restart(bridge, "f1")
        assert "/api/v1/targets/metadata" in prometheus.paths
    assert data["stop_notice"] == "not seen by Prometheus within 0.5 s; stopped anyway"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name == "robust_metrics.bridge.actions"]
    assert json.dumps(data)  # the step's data stays JSON
