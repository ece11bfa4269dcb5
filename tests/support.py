"""Shared helpers for tests: polling, skipping without a binary, the process harness, and a
valid sidecar configuration.

Processes (Prometheus, Alertmanager, the sidecar, the bridge, ranks) are started through
`robust_metrics.processes`, the harness the demo and the benchmarks use too; names are re-exported
here for the tests.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from robust_metrics.processes import (
    EXAMPLE,
    RankJob,
    Service,
    free_port,
    free_port_block,
    sidecar,
    stop_process_group,
    wait_for,
)
from robust_metrics.sidecar.config import SidecarConfig

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

__all__ = ["EXAMPLE", "ROOT", "RankJob", "SidecarProcess", "free_port", "free_port_block",
           "process_gone",
           "rank_job", "require_binary", "stop_process_group", "wait_until"]


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.1,
               message: str | Callable[[], str] = "condition") -> T:
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout` seconds."""
    try:
        return wait_for(predicate, timeout, interval, message)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def process_gone(pid: int) -> bool:
    """True once `pid` has exited: no such process, or a zombie its parent has yet to reap."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def require_binary(*names: str) -> str:
    """Path of the first binary found, or skip the test saying which package provides it."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"{' or '.join(names)} not installed (make test installs it with apt-get)")


@contextlib.contextmanager
def rank_job(nproc: int, args: Sequence[str] = (), **kwargs: object) -> Iterator[RankJob]:
    job = RankJob(nproc, args, **kwargs)  # type: ignore[arg-type]
    try:
        yield job
    finally:
        job.kill()


def SidecarProcess(directory: Path | str, args: Sequence[str] = (), *,
                   log_path: Path | None = None, env: dict[str, str] | None = None,
                   launcher: Sequence[str] = (sys.executable, "-m", "robust_metrics")) -> Service:
    """A real `robust-metrics sidecar` on a free loopback port, launched now; `with` waits until
    it is ready and stops it (then kills its group) at the end."""
    return sidecar(directory, args, log_path=log_path, env=env, launcher=launcher).launch()


def sidecar_config(tmp_path: Path, **kwargs: object) -> SidecarConfig:
    """A validated sidecar configuration of node `n1` reading `tmp_path/metrics` (no GPU or NCCL
    collector, so it builds on any machine), sysfs read from `tmp_path`."""
    config = SidecarConfig(directory=str(tmp_path / "metrics"), node="n1",
                           collectors=["ranks", "process", "nic"], sysfs=str(tmp_path), **kwargs)
    config.validate()
    return config
