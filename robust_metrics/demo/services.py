"""Processes the demo starts on loopback, each in its own session so one signal stops its tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from robust_metrics.processes import free_port, stop_process_group

__all__ = ["Service", "find_binary", "free_port", "http_ok"]


def find_binary(*names: str) -> str:
    """Path of the first of `names` on PATH; RuntimeError says how to install it."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(f"{' or '.join(names)} not found: install Debian's prometheus and "
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


@dataclass
class Service:
    """One long-running process with a log file and an HTTP readiness URL."""

    name: str
    argv: list[str]
    log_path: Path
    ready_url: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Service:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if http_ok(self.ready_url):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not ready at {self.ready_url} after {timeout:.0f}s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, timeout)
