"""The `local` scheduler: starts a command per run on this machine and restarts it on request.

It is what the demo uses to restart a `torchrun` job, and what a single-node user can use as is.
The process of each run is started in its own session (process group), so a restart stops the
whole tree (torchrun and its workers): SIGTERM to the group, `stop_timeout_s` to exit, then SIGKILL
to the group and to every descendant found before the first signal (workers in sessions of their
own, or stopped, included).

The pid, its start time and the id of the last operation are kept in `state_dir/<run>.json` (the
run name percent-encoded, so distinct runs never share a file), so a
bridge that was killed and started again still knows which process to stop (and does not kill a
stranger that reused the pid), and can tell whether an interrupted restart completed.

`robust-metrics job start|stop|status --config bridge.yaml RUN` (`bridge/job_cli.py`) builds this
adapter from the bridge's own policy file, so a run a person starts there is one the bridge can
restart. Operations that change a run hold an exclusive lock on `state_dir/<run>.lock` as well as
the adapter's thread lock, so the bridge and that command never stop or start one run at once.

Config::

    schedulers:
      local:
        type: local
        command: ["torchrun", "--nproc-per-node=2", "train.py", "--run-id={run}"]
        cwd: .                   # default: the policy file's folder
        env: {OMP_NUM_THREADS: "1"}
        state_dir: bridge-state  # default: local-scheduler next to the policy file
        log_dir: bridge-logs     # default: state_dir; each run appends to <run>.log
        stop_timeout_s: 30

`{run}` in the command or env values is replaced by the run name; ROBUST_METRICS_RUN is set too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil

from robust_metrics.bridge.schedulers.base import ActionResult, SchedulerError, check_keys, register
from robust_metrics.configuration import ConfigError

__all__ = ["LocalScheduler"]

_KEYS = {"command", "cwd", "env", "state_dir", "log_dir", "stop_timeout_s"}


def _file_stem(run: str) -> str:
    """One file name per run, never shared: percent-encoding keeps `job 1` (`job%201`) apart
    from `job_1`, and names of letters, digits, `_`, `.`, `-` unchanged. Long names are cut and
    end in `%-<sha256>`, which no encoded name can spell (its `%` is always followed by hex)."""
    stem = quote(run, safe="", errors="surrogatepass")
    if len(stem) <= 200:
        return stem
    digest = hashlib.sha256(run.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{stem[:100]}%-{digest}"


class LocalScheduler:
    """Start, restart, signal and stop one process group per run."""

    name = "local"

    def __init__(self, config: Mapping[str, Any], *, base_dir: str | Path = ".") -> None:
        """`base_dir`: the folder `cwd`, `state_dir` and `log_dir` are relative to (the policy
        file's, so the bridge and `robust-metrics job` share one state)."""
        check_keys(config, _KEYS, "local")
        command = config.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if not isinstance(command, list) or not command or not all(
                isinstance(c, str) for c in command):
            raise ConfigError("local scheduler: `command` must be a non-empty list of strings "
                              "(or one shell-quoted string)")
        base = Path(base_dir)
        self.command: list[str] = command
        self.cwd = str((base / str(config.get("cwd", "."))).resolve())
        env = config.get("env") or {}
        if not isinstance(env, Mapping):
            raise ConfigError("local scheduler: `env` must be a mapping of strings")
        self.env = {str(k): str(v) for k, v in env.items()}
        self.state_dir = (base / str(config.get("state_dir", "local-scheduler"))).resolve()
        self.log_dir = (base / str(config["log_dir"])).resolve() if config.get(
            "log_dir") else self.state_dir
        self.stop_timeout_s = float(config.get("stop_timeout_s", 30.0))
        self._lock = threading.RLock()
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ state
    def _state_path(self, run: str) -> Path:
        return self.state_dir / f"{_file_stem(run)}.json"

    def log_path(self, run: str) -> Path:
        """Where the run's output goes (appended across restarts)."""
        return self.log_dir / f"{_file_stem(run)}.log"

    @contextlib.contextmanager
    def _locked(self, run: str) -> Iterator[None]:
        """The run to ourselves: this adapter's threads and any other process on its state
        (another bridge, `robust-metrics job`) wait until the operation is over."""
        with self._lock:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            with open(self.state_dir / f"{_file_stem(run)}.lock", "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                yield

    def state(self, run: str) -> dict[str, Any]:
        """The recorded process of `run` (empty when it was never started here)."""
        try:
            return dict(json.loads(self._state_path(run).read_text()))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise SchedulerError(f"local scheduler: unreadable state for run {run!r}: {exc}") \
                from None

    def _write_state(self, run: str, state: Mapping[str, Any]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self._state_path(run)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(state)))
        os.replace(tmp, path)

    def _process(self, state: Mapping[str, Any]) -> psutil.Process | None:
        """The recorded process if it is still the same one (pid and start time) and alive."""
        pid = state.get("pid")
        if not pid:
            return None
        try:
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - float(state.get("create_time", 0))) > 0.5:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                self._reap(int(pid))
                return None
            return proc
        except psutil.Error:
            return None

    def _reap(self, pid: int) -> None:
        child = self._children.pop(pid, None)
        if child is not None:
            with contextlib.suppress(Exception):
                child.wait(timeout=1)

    def running(self, run: str) -> bool:
        return self._process(self.state(run)) is not None

    # ------------------------------------------------------------------ operations
    def start(self, run: str, *, key: str | None = None, reason: str = "start") -> ActionResult:
        """Start the run's command unless it is running already."""
        with self._locked(run):
            state = self.state(run)
            proc = self._process(state)
            if proc is not None:
                return ActionResult(True, f"run {run} already running as pid {proc.pid}",
                                    {"pid": proc.pid, "generation": state.get("generation", 0)})
            return self._spawn(run, state, key, reason)

    def _spawn(self, run: str, state: Mapping[str, Any], key: str | None,
               reason: str) -> ActionResult:
        argv = [part.replace("{run}", run) for part in self.command]
        env = {**os.environ, **{k: v.replace("{run}", run) for k, v in self.env.items()},
               "ROBUST_METRICS_RUN": run}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path(run)
        try:
            with open(log_path, "ab") as log:
                child = subprocess.Popen(argv, cwd=self.cwd, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError as exc:
            raise SchedulerError(f"local scheduler: cannot start {argv[0]!r} for run {run}: "
                                 f"{exc.strerror}") from None
        self._children[child.pid] = child
        try:
            create_time = psutil.Process(child.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        generation = int(state.get("generation", 0)) + 1
        self._write_state(run, {"pid": child.pid, "create_time": create_time,
                                "generation": generation, "last_key": key, "reason": reason,
                                "started": time.time(), "argv": argv})
        return ActionResult(True, f"started run {run} as pid {child.pid} (generation "
                            f"{generation})", {"pid": child.pid, "generation": generation,
                                               "log": str(log_path)})

    def _stop(self, run: str, state: Mapping[str, Any]) -> int | None:
        """Stop the run's process group; returns the stopped pid (None when nothing ran)."""
        proc = self._process(state)
        if proc is None:
            return None
        pgid = proc.pid  # started with start_new_session: the group is the leader's pid
        tree = _descendants(proc)  # before any signal: a killed parent's children are orphaned
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        if not self._wait_gone(proc, self.stop_timeout_s):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            self._wait_gone(proc, 10.0)
        # The leader is gone; stragglers of its group (workers that ignored SIGTERM) go too,
        # and descendants that left the group: a launcher may start its workers in sessions of
        # their own, and a stopped worker (SIGSTOP) never acts on the SIGTERM it forwards.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        for child in tree:
            with contextlib.suppress(psutil.Error):
                child.kill()  # psutil checks that the pid is still the same process
        self._reap(proc.pid)
        return proc.pid

    def _wait_gone(self, proc: psutil.Process, timeout: float) -> bool:
        """Wait for exit; a zombie counts as gone (its parent, maybe not us, reaps it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            child = self._children.get(proc.pid)
            if child is not None and child.poll() is not None:
                return True
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
            except psutil.Error:
                pass
            time.sleep(0.05)
        return False

    def restart(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        with self._locked(run):
            state = self.state(run)
            if not state:
                raise SchedulerError(f"local scheduler: run {run!r} was never started by this "
                                     "bridge; nothing to restart (start it with 'robust-metrics "
                                     "job start --config BRIDGE_YAML RUN', docs/bridge.md)")
            old = self._stop(run, state)
            result = self._spawn(run, state, key, reason)
        was = f"pid {old} stopped" if old else "it was not running"
        return ActionResult(True, f"restarted run {run} ({was}); {result.detail}",
                            {**result.data, "stopped_pid": old})

    def signal(self, run: str, signum: int, *, key: str | None = None) -> ActionResult:
        with self._lock:
            proc = self._process(self.state(run))
            if proc is None:
                return ActionResult(False, f"run {run} is not running")
            os.killpg(proc.pid, signum)
        return ActionResult(True, f"sent signal {signum} to run {run} (pgid {proc.pid})")

    def drain_node(self, node: str, reason: str, *, key: str | None = None) -> ActionResult:
        return ActionResult(False, "the local scheduler runs on one machine and cannot drain "
                            f"node {node}; use the slurm, kubernetes or webhook scheduler")

    def cancel(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        with self._locked(run):
            state = self.state(run)
            old = self._stop(run, state)
            if state:
                self._write_state(run, {**state, "pid": None, "last_key": key})
        return ActionResult(True, f"stopped run {run} (pid {old})" if old else
                            f"run {run} was not running")

    def completed(self, run: str, key: str) -> bool | None:
        """Whether the operation `key` finished (a restart records its key with the new pid)."""
        try:
            return self.state(run).get("last_key") == key
        except SchedulerError:
            return None

    def close(self) -> None:
        """Reap finished children; running jobs are left running (they outlive the bridge)."""
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                self._children.pop(pid, None)


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    """Every process started under `proc`, whatever its process group or session."""
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


@register("local")
def _factory(config: Mapping[str, Any], base_dir: Path) -> LocalScheduler:
    return LocalScheduler(config, base_dir=base_dir)
