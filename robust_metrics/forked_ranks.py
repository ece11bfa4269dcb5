"""Ranks of one job forked from a process that imported torch once.

`import torch` costs about 2 CPU-seconds, and FSDP2's, tensor parallelism's and pipelining's
modules about one more: a job of N ranks started by exec pays that N times, which on a small
machine is most of what a short test job costs. This launcher imports the modules it is asked
to preload, then forks every rank; each rank runs the training script as `__main__` with its own
environment, arguments and log, and ends as any Python process does (its atexit handlers and
excepthook run), so it is a real rank in every other respect. (PyTorch's own CPU DataLoader
workers are forked after `import torch` the same way.)

The ranks stay in the launcher's process group: ending the group ends the job. The launcher
writes each rank's pid to `<status>/rank<r>.pid` when it forks it and its exit status (as
`subprocess` reports one: the code, or minus the signal) to `<status>/rank<r>.exit` when it
exits, but reaps no rank until every rank has exited: a rank that died stays a zombie, as the
unwaited child of `subprocess.Popen` does, so the sidecar can read how it ended.

    python -m robust_metrics.forked_ranks SPEC.json

SPEC: {"script": path, "args": [...], "preload": [module, ...], "status": folder,
       "ranks": [{"env": {...}, "log": path or null}, ...]}
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["ForkedRank", "exit_code", "main", "write_spec"]

POLL_S = 0.05
FORK_TIMEOUT_S = 120.0  # the launcher's imports, on a loaded machine


def write_spec(status: Path, script: Path, args: list[str], preload: list[str],
               ranks: list[tuple[dict[str, str], Path | None]]) -> Path:
    """The launcher's SPEC file in `status`, for ranks given as (environment, log file)."""
    spec = {"script": str(script), "args": args, "preload": preload, "status": str(status),
            "ranks": [{"env": env, "log": str(log) if log else None} for env, log in ranks]}
    path = status / "spec.json"
    path.write_text(json.dumps(spec))
    return path


class ForkedRank:
    """One rank of a forked job, with the part of `subprocess.Popen` a job uses: `pid`,
    `poll()`, `wait()` and `returncode`."""

    def __init__(self, launcher: subprocess.Popen[Any], status: Path, number: int) -> None:
        self._launcher = launcher
        self._pid_file = status / f"rank{number}.pid"
        self._exit_file = status / f"rank{number}.exit"
        self._number = number
        self._pid: int | None = None
        self._code: int | None = None

    @property
    def forked(self) -> bool:
        return self._pid is not None or self._pid_file.exists()

    @property
    def pid(self) -> int:
        """The rank's pid, once the launcher has forked it (waits for that)."""
        deadline = time.monotonic() + FORK_TIMEOUT_S
        while self._pid is None:
            if self._pid_file.exists():
                self._pid = int(self._pid_file.read_text())
            elif self._launcher.poll() is not None:
                raise RuntimeError(f"the rank launcher exited ({self._launcher.returncode}) "
                                   f"before it forked rank {self._number}")
            elif time.monotonic() > deadline:
                raise TimeoutError(f"rank {self._number} not forked in {FORK_TIMEOUT_S:.0f}s")
            else:
                time.sleep(0.02)
        return self._pid

    def poll(self) -> int | None:
        """The rank's exit status, None while it runs. A launcher gone without recording it
        was killed, and its process group, the ranks, with it: its status stands for theirs."""
        if self._code is None:
            if self._exit_file.exists():
                self._code = int(self._exit_file.read_text())
            elif (launcher := self._launcher.poll()) is not None:
                self._code = (int(self._exit_file.read_text()) if self._exit_file.exists()
                              else launcher)
        return self._code

    def settle(self) -> None:
        """Keep the pid and status read from the status folder (before it is removed)."""
        if self.forked:
            self._pid = self.pid
        self.poll()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self._number}", timeout or 0.0)
            time.sleep(POLL_S)
        return code


def _write(path: Path, text: str) -> None:
    """Write `text` so that a reader sees the whole file or none."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def exit_code(info: os.waitid_result) -> int:
    """The exit status as `subprocess` gives it: the code of an exit, minus a killing signal."""
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _become_rank(spec: dict[str, Any], rank: dict[str, Any]) -> tuple[str, list[str]]:
    """In the forked child: the rank's output and environment; the script and its arguments."""
    log = rank.get("log") or os.devnull
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(rank["env"])
    return spec["script"], list(spec["args"])


def _wait_all(pids: dict[int, int], status: Path) -> None:
    """Record each rank's exit as it happens; reap them all once none is left running."""
    running = dict(pids)
    while running:
        for pid, rank in list(running.items()):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                _write(status / f"rank{rank}.exit", str(exit_code(info)))
                del running[pid]
        time.sleep(POLL_S)
    for pid in pids:
        os.waitpid(pid, 0)


def main(argv: list[str]) -> tuple[str, list[str]] | None:
    """In the launcher: fork the ranks and wait for them (None). In a rank: what to run."""
    spec = json.loads(Path(argv[0]).read_text())
    status = Path(spec["status"])
    for module in spec["preload"]:
        importlib.import_module(module)
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for number, rank in enumerate(spec["ranks"]):
        pid = os.fork()
        if pid == 0:
            return _become_rank(spec, rank)
        pids[pid] = number
        _write(status / f"rank{number}.pid", str(pid))
    _wait_all(pids, status)
    return None


if __name__ == "__main__":
    child = main(sys.argv[1:])
    if child is not None:
        script, args = child
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` sets it
        runpy.run_path(script, run_name="__main__")
