"""The bridge against a hostile but honest job, with a real Prometheus: a server that job labels
as a node is never taken for a sidecar when the sidecars are discovered from a scrape job.

A training job sets its own labels (`ROBUST_METRICS_NODE` becomes the `node` label of
`robust_rank_info` and of the alerts built on it). The tests that need no Prometheus:
tests/test_bridge_hostile.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.bridge_fakes import FakeSidecar, Recorder, alert, webhook
from tests.served_bridge import post, settled, start_bridge
from tests.support import wait_until

__all__ = ["start_bridge"]  # the fixture, imported for pytest


def test_discovered_sidecars_are_the_scrape_targets_of_their_job(start_bridge: Any,
                                                                  tmp_path: Path) -> None:
    """With `sidecars.discovery_job`, a node's sidecar is the target Prometheus scrapes in that
    job under that `node` label; a server Prometheus scrapes in another job is never a sidecar."""
    from tests.prometheus_fixture import PrometheusServer

    with Recorder() as evil, FakeSidecar(node="n1", run="r1", ranks=[0]) as side:
        evil_address = evil.url.removeprefix("http://")
        jobs = [{"job_name": "sidecars", "static_configs": [
                    {"targets": [side.url.removeprefix("http://")], "labels": {"node": "n1"}}]},
                {"job_name": "labelled", "static_configs": [
                    {"targets": [evil_address], "labels": {"node": "n2"}}]}]
        with PrometheusServer(tmp_path / "prom", [evil_address], job="other",
                              extra_scrape_configs=jobs) as prom:
            wait_until(lambda: len(prom.api("targets", state="active")["activeTargets"]) == 3,
                       30, message="three scrape targets")
            wait_until(lambda: evil.requests, 30, message="a scrape of the labelled server")
            client = start_bridge({
                "prometheus": {"url": prom.url},
                "sidecars": {"discovery_job": "sidecars", "token": "side-token"},
                "rules": [{"match": {"alertname": "Stacks"}, "actions": ["dump_stacks"]}]})
            sent = [alert("Stacks", fingerprint="n1", run="r1", node="n1"),
                    alert("Stacks", fingerprint="n2", run="r1", node="n2"),
                    alert("Stacks", fingerprint="bad", run="r1", node=evil_address)]
            assert post(client, webhook(*sent)).status_code == 200
            rows = {r["fingerprint"]: r for r in settled(client, 3)}
        assert rows["n1"]["status"] == "done" and side.stack_requests == 1, rows["n1"]["steps"]
        for name in ("n2", "bad"):
            assert rows[name]["status"] == "failed", rows[name]
            assert "not a configured sidecar host" in rows[name]["steps"][0]["detail"]
        # Prometheus scrapes it (that is what makes it a target); the bridge never calls it.
        assert evil.requests and all(r["path"] == "/metrics" and "Authorization" not in
                                     r["headers"] for r in evil.requests), evil.requests
