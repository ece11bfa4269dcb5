"""The VictoriaMetrics backend for real: two vmagent shards, VictoriaMetrics, vmalert, Alertmanager.

The deployment in exporters/vmagent/ splits the sidecars between vmagent shards with
`-promscrape.cluster.membersCount/memberNum`; here two shards scrape four targets and every target
must be scraped by exactly one of them, and vmalert's alert must reach Alertmanager.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.support import wait_until
from tests.victoriametrics_fixture import VictoriaMetricsServer, VMAgent, VMAlert, alertmanager_service

TARGETS = 12


class _Target(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f'robust_rank_process_alive{{run="r",rank="{self.server.server_port}"}} 1\n'.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def targets() -> Iterator[list[str]]:
    # Shards split targets by a hash of their labels, which is uneven for a few targets that
    # differ only in port: with 4, one shard got none in 2 runs of 2; with 12, both got some in
    # every run tried.
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Target) for _ in range(TARGETS)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [f"127.0.0.1:{s.server_port}" for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_two_vmagent_shards_scrape_each_target_once_and_vmalert_notifies(
        tmp_path: Path, targets: list[str]) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text("groups:\n- name: g\n  rules:\n"
                     "  - alert: RankAlive\n    expr: robust_rank_process_alive == 1\n")
    with VictoriaMetricsServer(tmp_path / "vm") as vm, \
            VMAgent(tmp_path / "a0", vm, targets, members=2, member=0) as shard0, \
            VMAgent(tmp_path / "a1", vm, targets, members=2, member=1) as shard1:
        scraped = []
        for shard in (shard0, shard1):
            active = httpx.get(f"{shard.url}/api/v1/targets", timeout=10).json()
            scraped.append({t["labels"]["instance"] for t in active["data"]["activeTargets"]})
        assert scraped[0] and scraped[1], f"a shard scrapes nothing: {scraped}"
        assert scraped[0].isdisjoint(scraped[1]), f"a target is scraped twice: {scraped}"
        assert scraped[0] | scraped[1] == set(targets)
        series = wait_until(lambda: len(vm.query("up == 1")) == TARGETS and vm.query("up == 1"),
                            timeout=30, interval=0.5,
                            message=f"{TARGETS} targets in VictoriaMetrics")
        assert {s["metric"]["instance"] for s in series} == set(targets)
        with alertmanager_service(tmp_path / "am") as am, \
                VMAlert(tmp_path / "vmalert", vm, rule_files=[rules], notifier_url=am):
            received = wait_until(
                lambda: len(httpx.get(f"{am}/api/v2/alerts", timeout=5).json()) == TARGETS
                and httpx.get(f"{am}/api/v2/alerts", timeout=5).json(),
                timeout=30, interval=0.5, message=f"{TARGETS} alerts in Alertmanager")
            assert {a["labels"]["alertname"] for a in received} == {"RankAlive"}
            assert {a["labels"]["instance"] for a in received} == set(targets)
