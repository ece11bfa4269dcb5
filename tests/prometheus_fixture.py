"""A real Prometheus (Debian 2.42) for integration tests: scrape targets, rule files, query API.

    with PrometheusServer(tmp_path, targets=["127.0.0.1:9741"], rule_files=[...]) as prom:
        prom.wait_for_targets_up(1)
        prom.query('up')

Storage lives under the test's temporary folder; the process runs in its own session and is
terminated (then killed) on exit. `require_binary` skips the test where Prometheus is missing.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from robust_metrics.processes import stop_process_group
from tests.support import free_port, require_binary, wait_until

__all__ = ["PrometheusServer", "QueryAPI", "prometheus_factory", "prometheus_server",
           "wait_for_series"]


class QueryAPI:
    """The Prometheus HTTP query API at `self.url`, which VictoriaMetrics serves too."""

    url: str

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns `data`, raising with Prometheus' own error text."""
        import httpx

        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"/api/v1/{path} {params}: {response.status_code} "
                                 f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the result vector (or a one-element list for a scalar)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def wait_for_targets_up(self, count: int, timeout: float = 30) -> None:
        def up() -> bool:
            return len(self.query("up == 1")) >= count
        wait_until(up, timeout=timeout, interval=0.5, message=f"{count} scrape targets up")


class PrometheusServer(QueryAPI):
    """One Prometheus process with a generated config; `query()` wraps /api/v1/query."""

    def __init__(self, workdir: Path, targets: Sequence[str] = (), *,
                 rule_files: Sequence[Path] = (), scrape_interval: str = "1s",
                 evaluation_interval: str = "1s", job: str = "robust-metrics",
                 extra_scrape_configs: Sequence[dict[str, Any]] = (),
                 extra_args: Sequence[str] = ()) -> None:
        self.binary = require_binary("prometheus")
        self.extra_args = list(extra_args)  # e.g. --web.enable-remote-write-receiver
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = self.workdir / "prometheus.yml"
        config: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": evaluation_interval},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]},
                               *extra_scrape_configs],
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrometheusServer:
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config_path}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
             *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            wait_until(self._ready, timeout=30, interval=0.2, message="Prometheus ready")
        except AssertionError:
            self.stop()
            raise AssertionError(f"Prometheus did not start:\n{self.logs()}") from None
        return self

    def _ready(self) -> bool:
        import httpx

        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"Prometheus exited with {self.proc.returncode}:\n{self.logs()}")
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, timeout=15)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def prometheus_server(workdir: Path, targets: Sequence[str] = (), **kwargs: Any
                      ) -> Iterator[PrometheusServer]:
    """Context manager form, for fixtures: `with prometheus_server(tmp, [...]) as prom:`."""
    server = PrometheusServer(workdir, targets, **kwargs)
    try:
        yield server.start()
    finally:
        server.stop()


def wait_for_series(prom: QueryAPI, expr: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Poll an instant query until it returns at least one series."""
    return wait_until(lambda: prom.query(expr), timeout=timeout, interval=0.5,
                      message=f"data for {expr}")


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Any]:
    """Call it with (targets, **kwargs) to start Prometheus; every one started is stopped."""
    started: list[PrometheusServer] = []

    def start(targets: Sequence[str] = (), **kwargs: Any) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus{len(started)}", targets, **kwargs)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()

