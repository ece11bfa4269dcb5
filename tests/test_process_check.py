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


def test_leftovers_sees_a_child_of_a_stopped_leader() -> None:
    proc = processes.spawn(["sh", "-c", "sleep 300 & exit 0"])
    proc.wait(timeout=10)
    try:
        assert any("sleep 300" in line for line in processes.leftovers())
    finally:
        processes.stop_process_group(proc)  # the leader is gone: its group is killed anyway
    assert not any("sleep 300" in line for line in processes.leftovers())
