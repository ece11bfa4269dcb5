"""The session-level check: a test session that leaves a started process alive fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from robust_metrics import processes
from tests.support import ROOT

LEAKY = '''
from robust_metrics.processes import spawn

def test_starts_and_forgets():
    spawn(["sleep", "300"])
'''
TIDY = '''
from robust_metrics.processes import spawn, stop_process_group

def test_starts_and_stops():
    stop_process_group(spawn(["sleep", "300"]))
'''


def _session(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_case.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.process_check", "-p",
         "no:cacheprovider", str(tmp_path / "test_case.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def _sleepers() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] == ["sleep", "300"]}


def test_a_process_left_running_fails_the_session_and_is_killed(tmp_path: Path) -> None:
    before = _sleepers()
    result = _session(tmp_path, LEAKY)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "still alive at the end of the session" in result.stdout
    assert "sleep 300" in result.stdout
    assert _sleepers() == before  # and it was killed, not left behind


def test_a_session_that_stops_its_processes_passes(tmp_path: Path) -> None:
    result = _session(tmp_path, TIDY)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "still alive" not in result.stdout


def _pids(lines: list[str]) -> set[int]:
    return {int(line.split()[0]) for line in lines}


def test_leftovers_sees_a_child_of_a_stopped_leader() -> None:
    # The child is known by its pid, not by its command line: that reads empty while the child
    # is inside execve, and "sh -c ..." before it.
    proc = processes.spawn(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    proc.stdout.close()
    proc.wait(timeout=10)
    try:
        assert child in _pids(processes.leftovers())
    finally:
        processes.stop_process_group(proc)  # the leader is gone: its group is killed anyway
    # SIGKILL takes effect when its target next runs: stop returns once the group is gone.
    assert child not in _pids(processes.leftovers())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_stopped_group_is_forgotten() -> None:
    proc = processes.spawn(["true"])
    proc.wait(timeout=10)
    processes.leftovers()
    assert all(p is not proc for p in processes._STARTED)


def test_a_reused_pid_does_not_make_another_group_ours() -> None:
    """Linux hands a free pid out again (pid_max is 32,768 on many machines); a recorded leader
    whose pid names another session's process now must not make that session a leftover."""
    stranger = subprocess.Popen(["sleep", "301"], start_new_session=True)
    proc = processes.spawn(["true"])
    proc.wait(timeout=10)
    proc.pid = stranger.pid  # stands for the kernel giving the reaped leader's pid to `stranger`
    try:
        assert stranger.pid not in _pids(processes.leftovers())
        assert all(p is not proc for p in processes._STARTED)
        processes.stop_process_group(proc)
        assert stranger.poll() is None, "stopping a reaped leader killed a group it did not lead"
    finally:
        stranger.kill()
        stranger.wait(timeout=10)
