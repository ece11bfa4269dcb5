"""Real VictoriaMetrics (Debian 1.79) for integration tests: the single-node server, vmalert and
vmagent, the second backend next to Prometheus (tests/prometheus_fixture.py).

    with VictoriaMetricsServer(tmp_path, targets=["127.0.0.1:9741"]) as vm, \\
            VMAlert(tmp_path / "vmalert", vm, rule_files=[...], notifier_url=am_url) as vmalert:
        vm.query('up')
        vmalert.api("alerts")

Every process listens on a free loopback port, keeps its data under the test's temporary folder,
runs in its own session and is terminated (then killed) on exit. `require_binary` skips the test
where the package is missing. VictoriaMetrics is started with `-search.latencyOffset=0s` and
`-search.disableCache` so that a sample is visible to the next query, as in Prometheus.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from robust_metrics.processes import QueryAPI, Service, alertmanager
from tests.support import free_port, require_binary

__all__ = ["VMAgent", "VMAlert", "VictoriaMetricsServer", "alertmanager_service",
           "scrape_config"]


def scrape_config(targets: Sequence[str], *, interval: str = "1s", job: str = "robust-metrics",
                  extra_scrape_configs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A Prometheus-format scrape configuration, read by both VictoriaMetrics and vmagent."""
    jobs = [{"job_name": job, "static_configs": [{"targets": list(targets)}]}] if targets else []
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval},
            "scrape_configs": [*jobs, *extra_scrape_configs]}


class _Process:
    """A VictoriaMetrics binary as a `Service`; start failures fail the test with its log."""

    service: Service

    def start(self, timeout: float = 30) -> Any:
        try:
            self.service.start(timeout=timeout)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None
        return self

    def logs(self) -> str:
        return self.service.log_tail(4000)

    @property
    def pid(self) -> int | None:
        return self.service.proc.pid if self.service.proc else None

    def stop(self) -> None:
        self.service.stop(timeout=15)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VictoriaMetricsServer(_Process, QueryAPI):
    """Single-node VictoriaMetrics: storage, the Prometheus query API, imports and remote write
    (`/api/v1/write`), and optionally its own scraping of `targets` (`-promscrape.config`)."""

    def __init__(self, workdir: Path, targets: Sequence[str] = (), *,
                 scrape_interval: str = "1s", job: str = "robust-metrics",
                 extra_scrape_configs: Sequence[dict[str, Any]] = (),
                 extra_args: Sequence[str] = ()) -> None:
        binary = require_binary("victoria-metrics")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [binary, f"-storageDataPath={self.workdir / 'data'}",
                f"-httpListenAddr=127.0.0.1:{self.port}", "-loggerLevel=WARN",
                "-search.latencyOffset=0s", "-search.disableCache", *extra_args]
        if targets or extra_scrape_configs:
            config = self.workdir / "scrape.yml"
            config.write_text(yaml.safe_dump(scrape_config(
                targets, interval=scrape_interval, job=job,
                extra_scrape_configs=extra_scrape_configs), sort_keys=False))
            argv.append(f"-promscrape.config={config}")
        self.service = Service("victoria-metrics", argv, port=self.port,
                               log_path=self.workdir / "victoria-metrics.log",
                               ready_url=f"{self.url}/health")

    def force_flush(self) -> None:
        """Make every sample received so far searchable now (it is within a second anyway)."""
        import httpx

        httpx.get(f"{self.url}/internal/force_flush", timeout=30).raise_for_status()

    def import_prometheus(self, text: str) -> None:
        """Ingest Prometheus exposition text (optional millisecond timestamps) and flush."""
        import httpx

        httpx.post(f"{self.url}/api/v1/import/prometheus", content=text.encode(),
                   timeout=60).raise_for_status()
        self.force_flush()


class VMAlert(_Process, QueryAPI):
    """vmalert evaluating Prometheus rule files against `datasource`, writing recorded series and
    alert state back to it, and notifying `notifier_url` (an Alertmanager).

    `api("alerts")` and `api("rules")` answer in Prometheus' format."""

    def __init__(self, workdir: Path, datasource: VictoriaMetricsServer, *,
                 rule_files: Sequence[Path], notifier_url: str,
                 evaluation_interval: str = "1s", extra_args: Sequence[str] = ()) -> None:
        binary = require_binary("vmalert")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [binary, *(f"-rule={Path(p).resolve()}" for p in rule_files),
                f"-datasource.url={datasource.url}", f"-remoteWrite.url={datasource.url}",
                f"-remoteRead.url={datasource.url}", f"-notifier.url={notifier_url}",
                f"-evaluationInterval={evaluation_interval}",
                f"-httpListenAddr=127.0.0.1:{self.port}", "-loggerLevel=WARN", *extra_args]
        self.service = Service("vmalert", argv, log_path=self.workdir / "vmalert.log",
                               port=self.port, ready_url=f"{self.url}/health")


class VMAgent(_Process):
    """vmagent scraping `targets` and remote-writing to `destination`; with `members` > 1 it is
    shard `member` of that many (`-promscrape.cluster.*`): each scrapes its share of targets."""

    def __init__(self, workdir: Path, destination: VictoriaMetricsServer,
                 targets: Sequence[str] = (), *, scrape_interval: str = "1s",
                 extra_scrape_configs: Sequence[dict[str, Any]] = (), members: int = 1,
                 member: int = 0, extra_args: Sequence[str] = ()) -> None:
        binary = require_binary("vmagent")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.workdir / "scrape.yml"
        config.write_text(yaml.safe_dump(scrape_config(
            targets, interval=scrape_interval, extra_scrape_configs=extra_scrape_configs),
            sort_keys=False))
        argv = [binary, f"-promscrape.config={config}",
                f"-remoteWrite.url={destination.url}/api/v1/write",
                f"-remoteWrite.tmpDataPath={self.workdir / 'queue'}",
                f"-httpListenAddr=127.0.0.1:{self.port}", "-loggerLevel=WARN", *extra_args]
        if members > 1:
            argv += [f"-promscrape.cluster.membersCount={members}",
                     f"-promscrape.cluster.memberNum={member}"]
        self.service = Service(f"vmagent{member}", argv, log_path=self.workdir / "vmagent.log",
                               port=self.port, ready_url=f"{self.url}/health")


@contextlib.contextmanager
def alertmanager_service(workdir: Path, config: dict[str, Any] | None = None
                         ) -> Iterator[str]:
    """A real Alertmanager on a free loopback port (no receiver by default); yields its URL."""
    require_binary("prometheus-alertmanager", "alertmanager")
    config = config or {"route": {"receiver": "null"}, "receivers": [{"name": "null"}]}
    service = alertmanager(Path(workdir), config)
    try:
        service.start(timeout=30)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None
    try:
        yield service.url
    finally:
        service.stop(timeout=15)
