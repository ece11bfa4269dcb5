"""Small helpers for the local processes the demo (and the tests) start on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess

__all__ = ["free_port", "stop_process_group"]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM the process's group (it was started with `start_new_session=True`), wait, then
    SIGKILL what is left; returns once the process is reaped."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
