"""The whole robust-metrics loop on one machine: configs generated into a run folder, services on
loopback ports, and the training job started through the bridge's own `local` scheduler.

    training ranks ─▶ metrics folder ─▶ sidecar ─▶ Prometheus (shipped rules, time-scaled)
        ▲                                              │ alerts
        └── local scheduler ◀── bridge ◀── Alertmanager (shipped routing, by `action`)
"""

from __future__ import annotations

import json
import secrets
import socket
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from robust_metrics import processes, rules
from robust_metrics.processes import Service, free_port

__all__ = ["QUERY_ERRORS", "RUN", "DemoStack"]

RUN = "demo"
QUERY_ERRORS = (processes.ServiceError, OSError, KeyError, ValueError, IndexError, TypeError)
"""What a failed query to Prometheus or the bridge raises."""
SCRAPE_SECONDS = 1
# The shipped rules are written for 15 s scrape and evaluation intervals; the demo runs at 1 s.
TIME_SCALE = SCRAPE_SECONDS / 15


@dataclass
class DemoStack:
    """Ports, configs and processes of one demo run, all under `folder`."""

    folder: Path
    ranks: int = 4
    step_sleep: float = 0.05
    node: str = field(default_factory=socket.gethostname)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    services: list[Service] = field(default_factory=list)
    prometheus: processes.Prometheus | None = None

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics_dir = self.folder / "metrics"
        self.job_dir = self.folder / "job"
        self.job_dir.mkdir(exist_ok=True)
        self.logs = self.folder / "logs"
        self.logs.mkdir(exist_ok=True)
        self.ports = {name: free_port() for name in
                      ("prometheus", "alertmanager", "sidecar", "bridge", "master")}
        self.url = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self.token_file = self.folder / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)

    # -- configuration ---------------------------------------------------------------------
    def write_configs(self) -> None:
        """The rules and the bridge's policy; Prometheus and Alertmanager get theirs in `start`."""
        groups = rules.load_groups(time_scale=TIME_SCALE)
        (self.folder / "rules.yml").write_text(rules.render(groups))
        (self.folder / "bridge.yaml").write_text(yaml.safe_dump(self._bridge_config(),
                                                                sort_keys=False))

    def _prometheus_config(self) -> dict[str, Any]:
        return {
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s",
                       "evaluation_interval": f"{SCRAPE_SECONDS}s",
                       "scrape_timeout": f"{SCRAPE_SECONDS}s"},
            "rule_files": [str(self.folder / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [
                {"targets": [f"127.0.0.1:{self.ports['alertmanager']}"]}]}]},
            "scrape_configs": [
                {"job_name": "robust-metrics-sidecar",
                 "static_configs": [{"targets": [f"127.0.0.1:{self.ports['sidecar']}"],
                                     "labels": {"node": self.node}}]},
                {"job_name": "robust-metrics-bridge",
                 "static_configs": [{"targets": [f"127.0.0.1:{self.ports['bridge']}"]}]},
            ],
        }

    def _alertmanager_config(self) -> dict[str, Any]:
        """The shipped routing example, pointed at this bridge, with demo-speed timers."""
        shipped = Path(rules.RULES_DIR) / "alertmanager.yml"
        config = yaml.safe_load(shipped.read_text())
        webhook = f"{self.url['bridge']}/api/v1/alerts"
        for receiver in config.get("receivers", []):
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = webhook
                hook.setdefault("http_config", {})["authorization"] = {
                    "type": "Bearer", "credentials_file": str(self.token_file)}
        route = config["route"]
        route.update(group_wait="1s", group_interval="2s", repeat_interval="1h")
        for child in route.get("routes", []):
            for key in ("group_wait", "group_interval"):
                if key in child:
                    child[key] = route[key]
        return config

    def _bridge_config(self) -> dict[str, Any]:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={self.ranks}", "-m", "robust_metrics.demo.train",
                    f"--run-dir={self.job_dir}", f"--step-sleep={self.step_sleep}"]
        return {
            "listen": {"host": "127.0.0.1", "port": self.ports["bridge"]},
            "database": str(self.folder / "bridge.db"),
            "auth": {"bearer_token_file": str(self.token_file)},
            "prometheus": {"url": self.url["prometheus"]},
            "sidecars": {"urls": {self.node: self.url["sidecar"]},
                         "token_file": str(self.token_file), "timeout_s": 15,
                         "ack_source": "sidecar"},
            "schedulers": {"local": {
                "type": "local", "command": launcher, "cwd": str(self.folder),
                "env": {"ROBUST_METRICS_DIR": str(self.metrics_dir), "OMP_NUM_THREADS": "1",
                        "ROBUST_METRICS_TIME_SCALE": repr(TIME_SCALE)},
                "state_dir": str(self.folder / "local-scheduler"), "log_dir": str(self.logs),
                "stop_timeout_s": 10}},
            "default_scheduler": "local",
            "restart_budget": {"max_restarts": 2, "window": "1h"},
            "rules": [
                {"name": "hang", "match": {"action": "restart"}, "cooldown_s": 120,
                 "actions": ["dump_stacks", {"type": "restart", "checkpoint_first": True}]},
                {"name": "stacks", "match": {"action": "dump_stacks"}, "cooldown_s": 120,
                 "actions": ["dump_stacks"]},
                {"name": "checkpoint", "match": {"action": "checkpoint"}, "cooldown_s": 120,
                 "actions": [{"type": "checkpoint", "timeout_s": 60}]},
            ],
        }

    # -- processes -------------------------------------------------------------------------
    def start(self) -> None:
        """Write the configs and start Prometheus, Alertmanager, the sidecar and the bridge."""
        self.write_configs()
        self.prometheus = processes.Prometheus(
            self.folder / "prometheus", config=self._prometheus_config(),
            port=self.ports["prometheus"], log_path=self.logs / "prometheus.log")
        specs = [
            processes.sidecar(self.metrics_dir, [
                f"--node={self.node}", f"--token-file={self.token_file}", "--merge-after=5",
                "--no-collector.nccl"], port=self.ports["sidecar"],
                log_path=self.logs / "sidecar.log"),
            processes.bridge(self.folder / "bridge.yaml", port=self.ports["bridge"],
                             log_path=self.logs / "bridge.log"),
            processes.alertmanager(self.folder / "alertmanager", self._alertmanager_config(),
                                   port=self.ports["alertmanager"],
                                   log_path=self.logs / "alertmanager.log"),
            self.prometheus,
        ]
        for service in specs:
            self.services.append(service.start())

    def _scheduler(self) -> Any:
        """The `local` scheduler with the bridge's config, so both share the job's state."""
        from robust_metrics.bridge.schedulers.local import LocalScheduler

        config = dict(self._bridge_config()["schedulers"]["local"])
        config.pop("type")
        return LocalScheduler(config)

    def start_job(self) -> None:
        """Start the training job through the same `local` scheduler state the bridge uses."""
        result = self._scheduler().start(RUN, reason="demo start")
        if not result.ok:
            raise RuntimeError(f"could not start the training job: {result.detail}")

    def stop_job(self) -> None:
        self._scheduler().cancel(RUN, "demo finished")

    def stop(self) -> None:
        """Stop the job and every service, newest first."""
        try:
            self.stop_job()
        finally:
            for service in reversed(self.services):
                service.stop()

    # -- queries ---------------------------------------------------------------------------
    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; ServiceError when Prometheus refuses it or cannot be reached."""
        return self._prom().query(expr)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self._prom().query_range(expr, start, end, step)

    def firing_alerts(self) -> list[dict[str, Any]]:
        return [a for a in self._prom().alerts() if a["state"] == "firing"]

    def _prom(self) -> processes.Prometheus:
        if self.prometheus is None:
            raise processes.ServiceError("Prometheus is not started")
        return self.prometheus

    def actions(self) -> list[dict[str, Any]]:
        return self._bridge_list("actions")

    def incidents(self) -> list[dict[str, Any]]:
        """The bridge's incident ledger of the run (newest first)."""
        return self._bridge_list("incidents")

    def _bridge_list(self, what: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(f"{self.url['bridge']}/api/v1/{what}?run={RUN}")
        request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=5) as response:
            body = json.load(response)
        return list(body.get(what, body) if isinstance(body, dict) else body)
