"""Checkpoint requests reaching a rank from outside: a signal, or a request file.

The sidecar's `/control/checkpoint` writes `control/checkpoint.json` into the metrics folder
(atomically, by rename); Slurm's convention is SIGUSR1 (`scancel --signal=USR1`). The hook looks at
step boundaries only, so the checkpoint callback runs where the model is consistent, and it adds no
collective: to make every rank checkpoint at the same step, a request may name `at_step`.

Request ids are milliseconds since the epoch, so ids from signals and files order by time and the
acknowledgement metric (`robust_checkpoint_request_id`) tells a waiter which request was handled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["CheckpointRequest", "ControlChannel", "request_path", "write_checkpoint_request"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRequest:
    id: int
    at_step: int | None = None


def request_path(metrics_dir: str) -> str:
    return os.path.join(metrics_dir, "control", "checkpoint.json")


def new_request_id() -> int:
    return time.time_ns() // 1_000_000


def write_checkpoint_request(metrics_dir: str, request_id: int | None = None,
                             at_step: int | None = None) -> CheckpointRequest:
    """Publish a request for the ranks writing into `metrics_dir` (used by the sidecar)."""
    request = CheckpointRequest(new_request_id() if request_id is None else request_id, at_step)
    path = request_path(metrics_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"id": request.id, "at_step": request.at_step}, f)
    os.replace(tmp, path)
    return request


def read_checkpoint_request(metrics_dir: str) -> CheckpointRequest | None:
    try:
        with open(request_path(metrics_dir)) as f:
            data = json.load(f)
        at_step = data.get("at_step")
        return CheckpointRequest(int(data["id"]), None if at_step is None else int(at_step))
    except FileNotFoundError:
        return None


class ControlChannel:
    """Collects checkpoint requests; `poll()` at step boundaries returns the newest unhandled one."""

    def __init__(self, metrics_dir: str | None, signum: int | None, poll_interval: float) -> None:
        self.metrics_dir = metrics_dir
        self.poll_interval = poll_interval
        self.handled_id = 0
        self._signal_id = 0
        self._signum = signum
        self._previous_handler: Any = None
        self._last_poll = 0.0
        self._last_mtime = 0
        self._file_request: CheckpointRequest | None = None
        if metrics_dir:  # a request older than this process is not for it
            existing = read_checkpoint_request_safely(metrics_dir)
            if existing is not None:
                self.handled_id = existing.id
                self._file_request = existing

    def install_signal(self) -> bool:
        """Install the signal handler; only possible from the main thread."""
        if self._signum is None or threading.current_thread() is not threading.main_thread():
            return False
        self._previous_handler = signal.signal(self._signum, self._on_signal)
        return True

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal_id = new_request_id()
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    def restore_signal(self) -> None:
        if self._previous_handler is not None and self._signum is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(self._signum, self._previous_handler)
            self._previous_handler = None

    def poll(self, now: float) -> CheckpointRequest | None:
        if self.metrics_dir and now - self._last_poll >= self.poll_interval:
            self._last_poll = now
            try:
                mtime = os.stat(request_path(self.metrics_dir)).st_mtime_ns
            except FileNotFoundError:
                mtime = 0
            if mtime and mtime != self._last_mtime:
                self._last_mtime = mtime
                self._file_request = read_checkpoint_request(self.metrics_dir)
        candidates = [r for r in (self._file_request,) if r is not None and r.id > self.handled_id]
        if self._signal_id > self.handled_id:
            candidates.append(CheckpointRequest(self._signal_id))
        return max(candidates, key=lambda r: r.id) if candidates else None


def read_checkpoint_request_safely(metrics_dir: str) -> CheckpointRequest | None:
    try:
        return read_checkpoint_request(metrics_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable checkpoint request in %s: %s", metrics_dir, exc)
        return None
