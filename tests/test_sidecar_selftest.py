"""`POST /control/selftest`: authenticated, strict about its body, bounded in time, one at a time,
and its report published as `robust_selftest_*` series by the `selftest` collector."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from robust_metrics.selftest.api import CheckResult, Report
from robust_metrics.sidecar.cli import build
from robust_metrics.sidecar.collectors.selftest import SelftestCollector
from robust_metrics.sidecar.config import SidecarConfig

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MEMORY = {"checks": ["memory"]}


def _client(tmp_path: Path, token: bool = True, **kwargs: object) -> TestClient:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = SidecarConfig(directory=str(tmp_path / "metrics"), node="n1", collectors=["selftest"],
                           token_file=str(token_file) if token else None, **kwargs)
    config.validate()
    app, _, _ = build(config)
    return TestClient(app)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with _client(tmp_path, selftest_args=["--memory-bytes=65536"]) as c:
        yield c


def _value(text: str, sample: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None


def test_a_passing_selftest_is_answered_and_published(client: TestClient) -> None:
    assert _value(client.get("/metrics").text, 'robust_selftest_passed{check="memory",node="n1"}') \
        is None
    response = client.post("/control/selftest", json=MEMORY, headers=AUTH)
    assert response.status_code == 200, response.text
    report = response.json()
    assert (report["node"], report["verdict"], report["failed"]) == ("n1", "pass", [])
    assert [r["check"] for r in report["results"]] == ["memory"]
    metrics = client.get("/metrics").text
    assert _value(metrics, 'robust_selftest_passed{check="memory",node="n1"}') == 1.0
    assert _value(metrics, 'robust_selftest_memory_verified_bytes{node="n1"}') == 65536.0
    assert _value(metrics, 'robust_selftest_last_run_timestamp_seconds{node="n1"}') == \
        pytest.approx(report["started"])


def test_an_injected_fault_fails_the_node(client: TestClient,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROBUST_SELFTEST_FAULT", "memory")  # inherited by the subprocess
    response = client.post("/control/selftest", json=MEMORY, headers=AUTH)
    assert response.status_code == 200
    assert response.json()["verdict"] == "fail" and response.json()["failed"] == ["memory"]
    metrics = client.get("/metrics").text
    assert _value(metrics, 'robust_selftest_passed{check="memory",node="n1"}') == 0.0


def test_without_a_token_file_the_endpoint_is_disabled(tmp_path: Path) -> None:
    with _client(tmp_path, token=False) as c:
        response = c.post("/control/selftest", headers=AUTH)
    assert response.status_code == 403 and "--token-file" in response.json()["error"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_a_missing_or_wrong_token_is_refused(client: TestClient, headers: dict) -> None:
    response = client.post("/control/selftest", json=MEMORY, headers=headers)
    assert response.status_code == 401


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "the body must be JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"quick": "yes"}', "quick='yes'"),
    (b'{"checks": ["disk"]}', "checks=['disk']"),
    (b'{"checks": "memory"}', "checks='memory'"),
    (b'{"expect_digest": "abc"}', "expect_digest"),
    (b'{"fleet_median_flops": -1}', "fleet_median_flops=-1"),
    (b'{"fleet_median_flops": true}', "fleet_median_flops=True"),
    (b'{"reboot": 1}', "unknown field(s) reboot"),
])
def test_bad_bodies_get_a_400_naming_the_field(client: TestClient, body: bytes,
                                               message: str) -> None:
    response = client.post("/control/selftest", content=body, headers=AUTH)
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_get_is_not_allowed(client: TestClient) -> None:
    assert client.get("/control/selftest", headers=AUTH).status_code == 405


def test_a_selftest_that_cannot_run_is_a_503_with_its_message(tmp_path: Path) -> None:
    with _client(tmp_path, selftest_args=["--memory-bytes=0"]) as c:
        response = c.post("/control/selftest", json=MEMORY, headers=AUTH)
    assert response.status_code == 503
    assert "must be a positive integer" in response.json()["error"]


def test_a_selftest_past_its_time_is_killed_and_the_next_waits_for_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROBUST_SELFTEST_FAULT", "compute:slow=30")
    # The timeout leaves room for the check's own start (`import torch`, over 3 s on a loaded
    # 2-core machine) so that the last request can only fail if the killed one still held the slot.
    with _client(tmp_path, selftest_timeout=8.0, selftest_args=["--memory-bytes=65536"]) as c:
        answers: list[int] = []
        first = threading.Thread(target=lambda: answers.append(c.post(
            "/control/selftest", json={"checks": ["compute"]}, headers=AUTH).status_code))
        first.start()
        time.sleep(0.5)
        busy = c.post("/control/selftest", json=MEMORY, headers=AUTH)
        first.join(30)
        assert busy.status_code == 429 and "already running" in busy.json()["error"]
        assert answers == [504]
        monkeypatch.delenv("ROBUST_SELFTEST_FAULT")
        assert c.post("/control/selftest", json=MEMORY, headers=AUTH).status_code == 200


def test_the_collector_publishes_no_verdict_for_a_skipped_check() -> None:
    collector = SelftestCollector("n2")
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    assert registry.get_sample_value("robust_selftest_last_run_timestamp_seconds",
                                     {"node": "n2"}) is None
    collector.publish(Report("n2", 1000.0, 2.0, (
        CheckResult("compute", "pass", 5e9, "flops", "ok", 0.5),
        CheckResult("communication", "fail", 1e8, "bytes_per_second", "slow pair", 1.0),
        CheckResult("gpu", "skipped", None, "", "no NVML", 0.01))))
    value = registry.get_sample_value
    assert value("robust_selftest_passed", {"node": "n2", "check": "compute"}) == 1.0
    assert value("robust_selftest_passed", {"node": "n2", "check": "communication"}) == 0.0
    assert value("robust_selftest_passed", {"node": "n2", "check": "gpu"}) is None
    assert value("robust_selftest_duration_seconds", {"node": "n2", "check": "gpu"}) == 0.01
    assert value("robust_selftest_compute_flops", {"node": "n2"}) == 5e9
    assert value("robust_selftest_bus_bandwidth_bytes_per_second", {"node": "n2"}) == 1e8
    assert value("robust_selftest_gpu_problems", {"node": "n2"}) is None
    assert value("robust_selftest_last_run_timestamp_seconds", {"node": "n2"}) == 1000.0
