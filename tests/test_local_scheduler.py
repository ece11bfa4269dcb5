"""The `local` scheduler stops a run's whole process tree, whatever its workers did to escape it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from robust_metrics.bridge.schedulers.local import LocalScheduler
from tests.support import process_gone, wait_until

# A launcher that starts its worker in a session of its own (as a launcher may), and whose worker
# ignores SIGTERM: only a SIGKILL aimed at the worker itself ends it.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
    start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(600)
"""



def test_a_restart_stops_a_stopped_worker_that_left_the_run_s_process_group(
        tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    local = LocalScheduler({"command": [sys.executable, "-c", LAUNCHER, str(pid_file)],
                            "state_dir": str(tmp_path / "state"), "stop_timeout_s": 1})
    workers: list[int] = []
    try:
        local.start("run")
        worker = wait_until(lambda: pid_file.exists() and int(pid_file.read_text() or 0),
                            timeout=30, message="the launcher to start its worker")
        workers.append(worker)
        os.kill(worker, signal.SIGSTOP)  # a hung rank, as py-spy or a debugger leaves it
        pid_file.unlink()
        result = local.restart("run", "RankHang", key="k#0")
        assert result.ok, result
        deadline = time.monotonic() + 10
        while not process_gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(worker), "the restart left the stopped worker of the old run behind"
        new_worker = wait_until(lambda: pid_file.exists() and int(pid_file.read_text() or 0),
                                timeout=30, message="the restarted launcher's worker")
        workers.append(new_worker)
        local.cancel("run", "test over")
        deadline = time.monotonic() + 10
        while not process_gone(new_worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(new_worker), "cancel left the worker behind"
    finally:
        local.cancel("run", "test over")
        for pid in workers:
            if not process_gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
