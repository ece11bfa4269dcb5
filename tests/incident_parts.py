"""Real parts for incident tests: a torchrun job of 2 gloo ranks started by the bridge's `local`
scheduler, the real sidecar serving the ranks' metrics, a real Prometheus scraping it, the bridge
(in this process, over HTTP) reading Prometheus, and a signed-webhook receiver for notifications.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.schedulers.local import LocalScheduler
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import Receiver, serve_app
from tests.prometheus_fixture import PrometheusServer
from tests.support import EXAMPLE, SidecarProcess, free_port

TOKEN = "incident-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RUN = "inc"


@dataclass
class Parts:
    client: httpx.Client
    bridge: Bridge
    local: LocalScheduler
    prom: PrometheusServer
    receiver: Receiver
    job_log: Path

    def scalar(self, expr: str) -> float | None:
        result = self.prom.query(expr)
        return float(result[0]["value"][1]) if result else None

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(path, headers=AUTH, params=params)
        assert r.status_code == 200, r.text
        return r.json()


@contextlib.contextmanager
def incident_parts(tmp: Path, job_args: Sequence[str], rules: list[dict[str, Any]],
                   incidents: dict[str, Any], scrape: str = "500ms",
                   rule_files: Sequence[Path] = (), sidecar_token: str | None = None,
                   ) -> Iterator[Parts]:
    """The parts; Prometheus also scrapes the bridge's /metrics and evaluates `rule_files`.
    With `sidecar_token` the sidecar takes it for /control and the bridge knows it (node n1)."""
    metrics_dir = tmp / "metrics"
    state = tmp / "local-scheduler"
    bridge_port = free_port()
    token_args: list[str] = []
    if sidecar_token:
        (tmp / "sidecar-token").write_text(sidecar_token)
        token_args = ["--token-file", str(tmp / "sidecar-token")]
    with SidecarProcess(metrics_dir, ["--node", "n1", "--no-collector.nvml",
                                      "--no-collector.nic", "--no-collector.nccl", *token_args],
                        log_path=tmp / "sidecar.log") as sidecar, \
            PrometheusServer(tmp / "prom", [sidecar.url.removeprefix("http://")],
                             scrape_interval=scrape, evaluation_interval=scrape,
                             rule_files=rule_files, extra_scrape_configs=[{
                                 "job_name": "bridge", "static_configs": [
                                     {"targets": [f"127.0.0.1:{bridge_port}"]}]}]) as prom, \
            Receiver(secret="notify-secret") as receiver:
        raw = {
            "database": "bridge.db", "auth": {"bearer_token": TOKEN},
            "prometheus": {"url": prom.url},
            "notify": {"url": receiver.url + "/notify", "secret": "notify-secret"},
            "schedulers": {"local": {
                "type": "local", "stop_timeout_s": 10, "state_dir": str(state),
                "command": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", str(EXAMPLE), *job_args],
                "env": {"ROBUST_METRICS_DIR": str(metrics_dir), "OMP_NUM_THREADS": "1"}}},
            "incidents": {"poll": "0.5s", **incidents},
            "rules": rules,
        }
        if sidecar_token:  # the ranks say they run on n1, the node the bridge can reach
            raw["sidecars"] = {"urls": {"n1": sidecar.url}, "token": sidecar_token}
            raw["schedulers"]["local"]["env"]["ROBUST_METRICS_NODE"] = "n1"
        bridge = Bridge(parse(raw, tmp))
        local = bridge.schedulers["local"]
        assert isinstance(local, LocalScheduler)
        with serve_app(create_app(bridge), port=bridge_port) as client:
            try:
                yield Parts(client, bridge, local, prom, receiver, state / f"{RUN}.log")
            finally:
                local.cancel(RUN, "test over")
