"""Shared helpers for tests that start real processes: free ports, rank jobs, polling."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest

from robust_metrics.processes import free_port, stop_process_group

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_ddp.py"
T = TypeVar("T")




def free_port_block(n: int) -> int:
    """A base port such that base..base+n-1 were all free a moment ago (in-process rank
    endpoints listen on ROBUST_METRICS_PORT + local rank)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("0.0.0.0", port))  # ranks listen on all addresses
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no block of {n} free loopback ports")


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.1,
               message: str = "condition") -> T:
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout` seconds."""
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
    raise AssertionError(f"timed out after {timeout}s waiting for {message}; last error: {last_exc}")


def require_binary(*names: str) -> str:
    """Path of the first binary found, or skip the test saying which package provides it."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"{' or '.join(names)} not installed (make test installs it with apt-get)")


class RankJob:
    """N real gloo ranks of a training script, started without torchrun so each pid is known."""

    def __init__(self, nproc: int, args: Sequence[str] = (), *, script: Path = EXAMPLE,
                 env: dict[str, str] | None = None, log_dir: Path | None = None,
                 run: str = "test-run",
                 rank_env: Callable[[int], dict[str, str]] | None = None) -> None:
        self.nproc = nproc
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log_dir = log_dir
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "WORLD_SIZE": str(nproc), "ROBUST_METRICS_RUN": run, "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
        for rank in range(nproc):
            per_rank = rank_env(rank) if rank_env else {}  # e.g. a node name per rank
            rank_env_ = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), **per_rank}
            out = open(log_dir / f"rank{rank}.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
            self.procs.append(subprocess.Popen(
                [sys.executable, str(script), *args], env=rank_env_, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait(self, timeout: float = 120) -> list[int]:
        """Wait for every rank; return their exit codes (kills them all on timeout)."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"ranks did not finish in {timeout}s\n{self.logs()}") from None

    def logs(self) -> str:
        if not self.log_dir:
            return ""
        return "\n".join(f"--- rank {r} ---\n" + (self.log_dir / f"rank{r}.log").read_text(
            errors="replace")[-3000:] for r in range(self.nproc))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=10)

    def __enter__(self) -> RankJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


@contextlib.contextmanager
def rank_job(nproc: int, args: Sequence[str] = (), **kwargs: object) -> Iterator[RankJob]:
    job = RankJob(nproc, args, **kwargs)  # type: ignore[arg-type]
    try:
        yield job
    finally:
        job.kill()


class SidecarProcess:
    """A real `robust-metrics sidecar` on a free loopback port, stopped (then killed) on exit.

    `args` are extra command-line flags; its output goes to `log_path` when given (read it with
    `output()` in failure messages). `launcher` replaces `python -m robust_metrics` (e.g. a script
    that installs a fake pynvml before calling `robust_metrics.cli.main`).
    """

    def __init__(self, directory: Path | str, args: Sequence[str] = (), *,
                 log_path: Path | None = None, env: dict[str, str] | None = None,
                 launcher: Sequence[str] = (sys.executable, "-m", "robust_metrics")) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        out = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*launcher, "sidecar", "--dir", str(directory),
             "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def wait_ready(self, timeout: float = 30) -> SidecarProcess:
        import httpx

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"sidecar exited with {self.proc.returncode}:\n{self.output()}")
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ready():
                    return self
            except AssertionError:
                raise
            except Exception:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"sidecar not ready after {timeout}s:\n{self.output()}")

    def stop(self) -> None:
        stop_process_group(self.proc)

    def __enter__(self) -> SidecarProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
