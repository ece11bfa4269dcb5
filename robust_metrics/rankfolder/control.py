"""`control/checkpoint.json`: checkpoint requests reaching a rank from outside, both ends.

The sidecar's `/control/checkpoint` writes `control/checkpoint.json` into the metrics folder
(atomically, by rename); Slurm's convention is SIGUSR1 (`scancel --signal=USR1`). The hook looks at
step boundaries only, so the checkpoint callback runs where the model is consistent, and it adds no
collective: to make every rank checkpoint at the same step, a request may name `at_step`.

The sidecar writes the file (`write_checkpoint_request`) and the hook reads it
(`ControlChannel`); a request can also come as a signal. Neither end follows a link planted in the
folder, and the reader never blocks on a FIFO or reads more than a few KiB.

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

from robust_metrics.rankfolder.safeio import open_dir, read_regular, write_atomic

__all__ = ["CheckpointRequest", "ControlChannel", "request_path", "write_checkpoint_request"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRequest:
    id: int
    at_step: int | None = None


CONTROL_DIR = "control"
REQUEST_FILE = "checkpoint.json"
MAX_REQUEST_BYTES = 4096


def request_path(metrics_dir: str) -> str:
    return os.path.join(metrics_dir, CONTROL_DIR, REQUEST_FILE)


def new_request_id() -> int:
    return time.time_ns() // 1_000_000


def write_checkpoint_request(metrics_dir: str, request_id: int | None = None,
                             at_step: int | None = None) -> CheckpointRequest:
    """Publish a request for the ranks writing into `metrics_dir` (used by the sidecar)."""
    request = CheckpointRequest(new_request_id() if request_id is None else request_id, at_step)
    os.makedirs(metrics_dir, exist_ok=True)
    fd = open_dir(os.path.join(metrics_dir, CONTROL_DIR), create=True)
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():  # a job made control/ first: the ranks would not trust it
            raise PermissionError(f"{os.path.join(metrics_dir, CONTROL_DIR)} belongs to uid "
                                  f"{owner}, not to this user")
        body = json.dumps({"id": request.id, "at_step": request.at_step}).encode()
        write_atomic(REQUEST_FILE, body, fd)
    finally:
        os.close(fd)
    return request


def read_checkpoint_request(metrics_dir: str) -> CheckpointRequest | None:
    """The current request, None when there is none; OSError or ValueError when unusable.

    Only a file written by root, by this process's user or by the folder's owner (the sidecar)
    counts: another job on the node must not make this one checkpoint.
    """
    try:
        fd = open_dir(os.path.join(metrics_dir, CONTROL_DIR), listing=False)
    except FileNotFoundError:
        return None
    try:
        owner = os.stat(REQUEST_FILE, dir_fd=fd, follow_symlinks=False).st_uid
        trusted = {0, os.geteuid(), os.stat(metrics_dir).st_uid}
        if owner not in trusted:
            raise PermissionError(f"{request_path(metrics_dir)} belongs to uid {owner}, "
                                  "neither the sidecar nor this job")
        data = json.loads(read_regular(REQUEST_FILE, MAX_REQUEST_BYTES, fd))
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    at_step = data.get("at_step")
    return CheckpointRequest(int(data["id"]), None if at_step is None else int(at_step))


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
                mtime = os.stat(request_path(self.metrics_dir), follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:
                mtime = 0
            if mtime and mtime != self._last_mtime:
                self._last_mtime = mtime
                self._file_request = read_checkpoint_request_safely(self.metrics_dir)
        candidates = [r for r in (self._file_request,) if r is not None and r.id > self.handled_id]
        if self._signal_id > self.handled_id:
            candidates.append(CheckpointRequest(self._signal_id))
        return max(candidates, key=lambda r: r.id) if candidates else None


def read_checkpoint_request_safely(metrics_dir: str) -> CheckpointRequest | None:
    try:
        return read_checkpoint_request(metrics_dir)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring unreadable checkpoint request in %s: %s", metrics_dir, exc)
        return None
