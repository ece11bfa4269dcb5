"""The harness for local processes: Prometheus, Alertmanager, VictoriaMetrics (server, vmagent,
vmalert), the sidecar, the bridge and ranks.

The demo, the tests and the benchmarks start the same services on loopback ports; this module is
the one place that knows how. Every process is started in its own session (so one signal to its
group stops its whole tree) and recorded, so a test session can fail when something it started is
still alive at its end (`leftovers()`).

    with Prometheus(workdir, ["127.0.0.1:9400"], rule_files=[rules]) as prom:
        prom.query("up")
    with sidecar(metrics_dir, ["--node", "n1"]) as side:
        httpx.get(side.url + "/metrics")
    with RankJob(2, ["--steps", "50"], log_dir=tmp) as job:
        job.wait()

Nothing here imports torch or an HTTP client library: the demo needs it with the base install.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import yaml

from robust_metrics.forked_ranks import ForkedRank, write_spec

__all__ = [
    "EXAMPLE",
    "MissingBinary",
    "Prometheus",
    "QueryAPI",
    "RankJob",
    "Service",
    "ServiceError",
    "VMAgent",
    "VMAlert",
    "VictoriaMetrics",
    "alertmanager",
    "bridge",
    "find_binary",
    "free_port",
    "free_port_block",
    "http_ok",
    "kill_leftovers",
    "leftovers",
    "scrape_config",
    "sidecar",
    "spawn",
    "stop_process_group",
    "wait_for",
]

T = TypeVar("T")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"


class ServiceError(RuntimeError):
    """A local service exited at start or did not become ready; the message holds its log."""


class MissingBinary(ServiceError):
    """A program (prometheus, alertmanager) is not installed."""


# ---------------------------------------------------------------------- ports
_LOWEST_PORT = 15000
_handed_out: set[int] = set()


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to `bind(0)` and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int) -> int:
    """A base port such that base..base+n-1 were all free a moment ago (in-process rank
    endpoints listen on ROBUST_METRICS_PORT + local rank).

    Blocks come from below the kernel's ephemeral range: a port there is only taken by an
    explicit bind, while gloo's many connections draw on the ephemeral range and could take
    a port between this check and the rank's own bind. A port is never handed out twice by
    one process, so two services started together cannot be given the same one.
    """
    highest = _ephemeral_floor() - n
    for _ in range(200):
        base = random.randint(_LOWEST_PORT, highest) if highest > _LOWEST_PORT else _kernel_port()
        if base + n > 65536 or _handed_out.intersection(range(base, base + n)):
            continue
        if _bindable(range(base, base + n)):
            _handed_out.update(range(base, base + n))
            return base
    raise RuntimeError(f"no block of {n} free ports")


def _kernel_port() -> int:
    """A port the kernel picks (used where the ephemeral range leaves no room below it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A TCP port, free on every address a moment ago, that this process has not handed out."""
    return free_port_block(1)


def _bindable(ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("0.0.0.0", port))  # ranks listen on all addresses
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.1,
             message: str | Callable[[], str] = "condition") -> T:
    """Poll `predicate` until it returns a truthy value (exceptions count as not yet); its
    value, or TimeoutError naming `message` and the last exception after `timeout` seconds.

    A callable `message` is called at the timeout, so a log it quotes is the log at the
    failure, not at the start of the wait.
    """
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the thing polled may not be up yet
            last_exc = exc
        time.sleep(interval)
    what = message() if callable(message) else message
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last error: {last_exc}")


# ---------------------------------------------------------------------- processes
_STARTED: list[subprocess.Popen[Any]] = []
_STARTED_LOCK = threading.Lock()


def spawn(argv: Sequence[str], *, log_path: Path | None = None, env: Mapping[str, str] | None = None,
          cwd: Path | str | None = None, stdout: int | IO[Any] | None = None,
          append: bool = True, inherit_env: bool = True) -> subprocess.Popen[Any]:
    """Start `argv` in its own session, output to `log_path` (or `stdout`, default: discarded),
    with `env` added to this process's environment (or as the whole environment without
    `inherit_env`); recorded for `leftovers()`."""
    out: int | IO[Any]
    if log_path is not None:
        out = open(log_path, "ab" if append else "wb")  # noqa: SIM115 - the child owns a copy
    else:
        out = subprocess.DEVNULL if stdout is None else stdout
    try:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd,
                                env={**(os.environ if inherit_env else {}), **(env or {})})
    finally:
        if log_path is not None:
            out.close()  # type: ignore[union-attr]
    with _STARTED_LOCK:
        _STARTED.append(proc)
    return proc


def stop_process_group(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM the process's group (it was started with `start_new_session=True`), wait, then
    SIGKILL what is left of the group; returns once the process is reaped and no live member
    of its group is left (a signal is delivered when its target next runs, which on a loaded
    machine is not at once), or after `timeout` more seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
    # The leader is gone; children that ignored SIGTERM (or were never sent it) go too.
    _kill_group_and_wait(proc, timeout)


def _kill_group_and_wait(proc: subprocess.Popen[Any], timeout: float) -> None:
    """SIGKILL the group of a reaped leader while it may still hold members of ours, wait until
    none of them is alive, then forget the process."""
    if _group_left(proc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while _group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    _forget_if_gone(proc)


def leftovers() -> list[str]:
    """`pid command` of every live process in a group this harness started (zombies excluded)."""
    import psutil

    with _STARTED_LOCK:
        started = list(_STARTED)
    groups = {p.pid for p in started if not _forget_if_gone(p)}
    alive = []
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(proc.pid) in groups and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:200]}")
        except (ProcessLookupError, psutil.Error):
            continue
    return sorted(alive)


def kill_leftovers() -> None:
    """SIGKILL every process group this harness started that is still alive, and reap them."""
    with _STARTED_LOCK:
        started = list(_STARTED)
    for proc in started:
        _kill_group_now(proc)


def _kill_group_now(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGKILL the group of a started process that still runs, reap it, and wait until no
    member of its group is alive."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    _kill_group_and_wait(proc, timeout)


def _tracked(proc: subprocess.Popen[Any]) -> bool:
    with _STARTED_LOCK:
        return any(p is proc for p in _STARTED)


def _group_left(proc: subprocess.Popen[Any]) -> bool:
    """Whether the group `proc` leads may still have live members: the leader runs, or it is
    reaped and some live process has its pid as group id while the pid itself is free.

    While a member of the leader's group lives, the kernel keeps the leader's pid reserved; a
    reaped leader no longer has /proc/<pid>. So a process or thread there took the pid after
    the group ended, and any group of that id now is someone else's.
    """
    if proc.poll() is None:
        return True
    return not os.path.exists(f"/proc/{proc.pid}") and bool(_group_members(proc.pid))


def _forget_if_gone(proc: subprocess.Popen[Any]) -> bool:
    """Forget a started process once it is reaped and its group has no live member; True when
    it is forgotten (now or before).

    Its pid is free from then on, and Linux hands pids out again soon (pid_max is 32,768 on
    many machines and every thread of a torch rank takes one): kept, the old pid would make a
    later, unrelated process group (another test session's, say) look like ours, to be listed
    by `leftovers()` and killed by `kill_leftovers()`.
    """
    if not _tracked(proc):
        return True
    if _group_left(proc):
        return False
    with _STARTED_LOCK, contextlib.suppress(ValueError):
        _STARTED.remove(proc)
    return True


def _group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid`."""
    import psutil

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # no process at all, zombies included
    except PermissionError:
        pass  # a member we may not signal: look closer
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


# ---------------------------------------------------------------------- services
def find_binary(*names: str) -> str:
    """Path of the first of `names` on PATH; MissingBinary says how to install it."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise MissingBinary(f"{' or '.join(names)} not found: install Debian's prometheus and "
                        "prometheus-alertmanager packages (make demo does it as root)")


def http_ok(url: str, token: str | None = None, timeout: float = 2.0) -> bool:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return bool(200 <= response.status < 300)
    except OSError:
        return False


class Service:
    """One long-running local process with a log file and an HTTP readiness URL.

    `launch()` starts it, `wait_ready()` waits for the URL to answer 2xx, `start()` does both
    (and nothing when it runs already); as a context manager it is started and stopped.
    """

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path | None = None,
                 ready_url: str | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path | str | None = None, port: int | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.ready_url = ready_url
        self.env = dict(env or {})
        self.cwd = cwd
        self.port = port
        self.url = f"http://127.0.0.1:{port}" if port else ""
        self.proc: subprocess.Popen[Any] | None = None

    def launch(self) -> Service:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = spawn(self.argv, log_path=self.log_path, env=self.env, cwd=self.cwd)
        return self

    def wait_ready(self, timeout: float = 60.0,
                   ready: Callable[[], bool] | None = None) -> Service:
        """Wait until `ready()` (default: the readiness URL answers 2xx); stop it on failure."""
        self.launch()
        check = ready or (lambda: self.ready_url is None or http_ok(self.ready_url))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServiceError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(Exception):
                if check():
                    return self
            time.sleep(0.1)
        self.stop()
        raise ServiceError(f"{self.name} not ready at {self.ready_url} after {timeout:.0f}s:\n"
                           f"{self.log_tail()}")

    def start(self, timeout: float = 60.0) -> Service:
        return self.wait_ready(timeout)

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def logs(self) -> str:
        return self.log_tail()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, timeout)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class QueryAPI:
    """The Prometheus HTTP query API at `self.url`; VictoriaMetrics and vmalert serve it too."""

    url: str

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns `data`, raising ServiceError with Prometheus' error text."""
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            text = exc.read()
            try:
                body = json.loads(text or b"{}")
            except ValueError:  # VictoriaMetrics answers some errors in plain text
                raise ServiceError(f"{self.url}/api/v1/{path} {params}: HTTP {exc.code}: "
                                   f"{text[:300].decode(errors='replace')}") from None
        except (OSError, ValueError) as exc:
            raise ServiceError(f"{self.url} unreachable: {exc}") from None
        if body.get("status") != "success":
            raise ServiceError(f"{self.url}/api/v1/{path} {params}: {body.get('errorType')}: "
                               f"{body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the result vector (or a one-element list for a scalar)."""
        data = self.api("query", query=expr, **({} if at is None else {"time": at}))
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float,
                    step: float) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])

    def wait_for_targets_up(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.query("up == 1")) < count:
            if time.monotonic() > deadline:
                raise ServiceError(f"fewer than {count} scrape targets up after {timeout:g}s:\n"
                                   f"{self.query('up')}")
            time.sleep(0.5)


class Prometheus(Service, QueryAPI):
    """Prometheus scraping `targets` as `job` (or with `config` as its whole configuration);
    config, storage and log (unless `log_path`) under `workdir`. `query()`, `query_range()` and
    `api()` wrap its HTTP API. Not started by the constructor: use `with` or `.start()`."""

    def __init__(self, workdir: Path, targets: Sequence[str] = (), *,
                 rule_files: Sequence[Path] = (), scrape_interval: str = "1s",
                 evaluation_interval: str = "1s", job: str = "robust-metrics",
                 extra_scrape_configs: Sequence[Mapping[str, Any]] = (),
                 port: int | None = None, config: Mapping[str, Any] | None = None,
                 log_path: Path | None = None, extra_args: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        if config is None:
            config = {
                "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                           "evaluation_interval": evaluation_interval},
                "rule_files": [str(Path(p).resolve()) for p in rule_files],
                "scrape_configs": [{"job_name": job,
                                    "static_configs": [{"targets": list(targets)}]},
                                   *extra_scrape_configs],
            }
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        super().__init__(
            "prometheus", [find_binary("prometheus"), f"--config.file={self.config_path}",
                           f"--storage.tsdb.path={self.workdir / 'data'}",
                           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
                           *extra_args],
            log_path=log_path or self.workdir / "prometheus.log", port=port,
            ready_url=f"http://127.0.0.1:{port}/-/ready")

    def start(self, timeout: float = 60.0) -> Prometheus:
        super().start(timeout)
        return self

    def __enter__(self) -> Prometheus:
        return self.start()


def scrape_config(targets: Sequence[str], *, interval: str = "1s", job: str = "robust-metrics",
                  extra_scrape_configs: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A Prometheus-format scrape configuration, read by VictoriaMetrics and vmagent too."""
    jobs = [{"job_name": job, "static_configs": [{"targets": list(targets)}]}] if targets else []
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval},
            "scrape_configs": [*jobs, *extra_scrape_configs]}


class VictoriaMetrics(Service, QueryAPI):
    """Single-node VictoriaMetrics: storage, the Prometheus query API, imports and remote write
    (`/api/v1/write`), and optionally its own scraping of `targets` (`-promscrape.config`).
    Started with `-search.latencyOffset=0s` and `-search.disableCache`, so that a sample is
    visible to the next query, as in Prometheus. Data and log under `workdir`."""

    def __init__(self, workdir: Path, targets: Sequence[str] = (), *,
                 scrape_interval: str = "1s", job: str = "robust-metrics",
                 extra_scrape_configs: Sequence[Mapping[str, Any]] = (),
                 extra_args: Sequence[str] = (), port: int | None = None) -> None:
        binary = find_binary("victoria-metrics")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        argv = [binary, f"-storageDataPath={self.workdir / 'data'}",
                f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN",
                "-search.latencyOffset=0s", "-search.disableCache", *extra_args]
        if targets or extra_scrape_configs:
            config = self.workdir / "scrape.yml"
            config.write_text(yaml.safe_dump(scrape_config(
                targets, interval=scrape_interval, job=job,
                extra_scrape_configs=extra_scrape_configs), sort_keys=False))
            argv.append(f"-promscrape.config={config}")
        super().__init__("victoria-metrics", argv, port=port,
                         log_path=self.workdir / "victoria-metrics.log",
                         ready_url=f"http://127.0.0.1:{port}/health")

    def force_flush(self) -> None:
        """Make every sample received so far searchable now (it is within a second anyway)."""
        with urllib.request.urlopen(f"{self.url}/internal/force_flush", timeout=30):
            pass


class VMAlert(Service, QueryAPI):
    """vmalert evaluating Prometheus rule files against `datasource`, writing recorded series and
    alert state back to it, and notifying `notifier_url` (an Alertmanager).

    `api("alerts")` and `api("rules")` answer in Prometheus' format."""

    def __init__(self, workdir: Path, datasource: VictoriaMetrics, *,
                 rule_files: Sequence[Path], notifier_url: str,
                 evaluation_interval: str = "1s", extra_args: Sequence[str] = (),
                 port: int | None = None) -> None:
        binary = find_binary("vmalert")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        argv = [binary, *(f"-rule={Path(p).resolve()}" for p in rule_files),
                f"-datasource.url={datasource.url}", f"-remoteWrite.url={datasource.url}",
                f"-remoteRead.url={datasource.url}", f"-notifier.url={notifier_url}",
                f"-evaluationInterval={evaluation_interval}",
                f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN", *extra_args]
        super().__init__("vmalert", argv, log_path=self.workdir / "vmalert.log", port=port,
                         ready_url=f"http://127.0.0.1:{port}/health")


class VMAgent(Service):
    """vmagent scraping `targets` and remote-writing to `destination`; with `members` > 1 it is
    shard `member` of that many (`-promscrape.cluster.*`): each scrapes its share of targets."""

    def __init__(self, workdir: Path, destination: VictoriaMetrics,
                 targets: Sequence[str] = (), *, scrape_interval: str = "1s",
                 extra_scrape_configs: Sequence[Mapping[str, Any]] = (), members: int = 1,
                 member: int = 0, extra_args: Sequence[str] = (),
                 port: int | None = None) -> None:
        binary = find_binary("vmagent")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        config = self.workdir / "scrape.yml"
        config.write_text(yaml.safe_dump(scrape_config(
            targets, interval=scrape_interval, extra_scrape_configs=extra_scrape_configs),
            sort_keys=False))
        argv = [binary, f"-promscrape.config={config}",
                f"-remoteWrite.url={destination.url}/api/v1/write",
                f"-remoteWrite.tmpDataPath={self.workdir / 'queue'}",
                f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN", *extra_args]
        if members > 1:
            argv += [f"-promscrape.cluster.membersCount={members}",
                     f"-promscrape.cluster.memberNum={member}"]
        super().__init__(f"vmagent{member}", argv, log_path=self.workdir / "vmagent.log",
                         port=port, ready_url=f"http://127.0.0.1:{port}/health")


def alertmanager(workdir: Path, config: Mapping[str, Any], *, port: int | None = None,
                 log_path: Path | None = None) -> Service:
    """Alertmanager with `config` (routes, receivers), single node, state under `workdir`."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(dict(config), sort_keys=False))
    return Service(
        "alertmanager", [find_binary("prometheus-alertmanager", "alertmanager"),
                         f"--config.file={workdir / 'alertmanager.yml'}",
                         f"--storage.path={workdir / 'data'}",
                         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                         "--log.level=warn"],
        log_path=log_path or workdir / "alertmanager.log",
        ready_url=f"http://127.0.0.1:{port}/-/ready",
        port=port)


def sidecar(directory: Path | str, args: Sequence[str] = (), *, port: int | None = None,
            log_path: Path | None = None, env: Mapping[str, str] | None = None,
            launcher: Sequence[str] = (sys.executable, "-m", "robust_metrics")) -> Service:
    """`robust-metrics sidecar` reading `directory`, on a loopback port; `args` are extra flags.
    `launcher` replaces `python -m robust_metrics` (e.g. a script that installs a fake pynvml)."""
    port = port or free_port()
    return Service("sidecar", [*launcher, "sidecar", "--dir", str(directory),
                               "--listen", f"127.0.0.1:{port}", *args],
                   log_path=log_path, env=env, port=port,
                   ready_url=f"http://127.0.0.1:{port}/healthz")


def bridge(config_path: Path, args: Sequence[str] = (), *, port: int | None = None,
           log_path: Path | None = None, env: Mapping[str, str] | None = None,
           cwd: Path | str | None = None) -> Service:
    """`robust-metrics bridge` with the policy file `config_path` (its `listen` port is
    overridden); `args` are extra flags."""
    port = port or free_port()
    return Service("bridge", [sys.executable, "-m", "robust_metrics", "bridge", "--config",
                              str(config_path), "--port", str(port), *args],
                   log_path=log_path, env={"PYTHONUNBUFFERED": "1", **(env or {})}, cwd=cwd,
                   port=port, ready_url=f"http://127.0.0.1:{port}/healthz")


# ---------------------------------------------------------------------- ranks
RANK_PRELOAD: tuple[str, ...] = ()
"""Modules the ranks of a `RankJob` share one import of: when set, a launcher imports them once
and forks every rank (`robust_metrics.forked_ranks`) instead of starting each with its own
interpreter. The test suite sets it: it starts about 200 ranks, each of which would spend 2-3
CPU-seconds importing torch."""


class RankJob:
    """N real gloo ranks of a training script, started without torchrun so each pid is known:
    each rank its own interpreter in its own session, or, with `preload` (default
    `RANK_PRELOAD`), forked by one launcher that imported those modules, all in the launcher's
    session."""

    def __init__(self, nproc: int, args: Sequence[str] = (), *, script: Path = EXAMPLE,
                 env: Mapping[str, str] | None = None, log_dir: Path | None = None,
                 run: str = "test-run",
                 rank_env: Callable[[int], dict[str, str]] | None = None,
                 preload: Sequence[str] | None = None) -> None:
        self.nproc = nproc
        self.port = free_port()
        self.log_dir = log_dir
        base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "WORLD_SIZE": str(nproc), "ROBUST_METRICS_RUN": run, "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
        ranks = [({"RANK": str(rank), "LOCAL_RANK": str(rank),
                   **(rank_env(rank) if rank_env else {})},  # e.g. a node name per rank
                  log_dir / f"rank{rank}.log" if log_dir else None) for rank in range(nproc)]
        preload = RANK_PRELOAD if preload is None else tuple(preload)
        self._launcher: subprocess.Popen[Any] | None = None
        self._status: Path | None = None
        self.procs: list[subprocess.Popen[Any] | ForkedRank] = []
        if preload:
            self._status = Path(tempfile.mkdtemp(prefix="robust-ranks-"))
            spec = write_spec(self._status, script, list(args), list(preload), ranks)
            self._launcher = spawn([sys.executable, "-m", "robust_metrics.forked_ranks", str(spec)],
                                   env=base, log_path=(log_dir or self._status) / "launcher.log")
            self.procs = [ForkedRank(self._launcher, self._status, r) for r in range(nproc)]
            return
        for rank_vars, log in ranks:
            self.procs.append(spawn([sys.executable, str(script), *args],
                                    env={**base, **rank_vars}, log_path=log, append=False))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait(self, timeout: float = 120) -> list[int]:
        """Wait for every rank; their exit codes (all are killed and ServiceError raised on
        timeout)."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise ServiceError(f"ranks did not finish in {timeout}s\n{self.logs()}") from None

    def logs(self) -> str:
        if not self.log_dir:
            return ""
        files = [(f"rank {r}", self.log_dir / f"rank{r}.log") for r in range(self.nproc)]
        files.append(("rank launcher", self.log_dir / "launcher.log"))
        return "\n".join(f"--- {name} ---\n" + path.read_text(errors="replace")[-3000:]
                         for name, path in files if path.exists())

    def kill(self) -> None:
        if self._launcher is not None:
            self._kill_forked(self._launcher)
            return
        for p in self.procs:
            if p.poll() is None:  # a reaped rank's pid may be another process's by now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=10)
            _kill_group_and_wait(p, 10.0)  # type: ignore[arg-type]

    def _kill_forked(self, launcher: subprocess.Popen[Any]) -> None:
        """Kill the ranks that run and let the launcher reap them and exit (so that no rank is
        left a zombie for init); then end what is left of its group."""
        if launcher.poll() is None:
            for p in self.procs:  # unreaped while the launcher runs: the pid is still the rank's
                if isinstance(p, ForkedRank) and p.forked and p.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=10)
        _kill_group_now(launcher)
        for p in self.procs:
            if isinstance(p, ForkedRank):
                p.settle()
        if self._status is not None:
            shutil.rmtree(self._status, ignore_errors=True)

    def __enter__(self) -> RankJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
