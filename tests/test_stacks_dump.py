"""`dump_stacks` against real processes with the real py-spy: live, dead, not Python, slow."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from robust_metrics.sidecar import stacks
from robust_metrics.sidecar.stacks import dump_stacks, find_py_spy

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    def helper_loop():
        while True:
            time.sleep(0.2)
    def wait_for_batch():
        secret = "hunter2"
        while True:
            time.sleep(0.2)
    threading.Thread(target=helper_loop, name="helper", daemon=True).start()
    print("ready", flush=True)
    wait_for_batch()
""")


@pytest.fixture(scope="module")
def py_spy() -> str:
    found = find_py_spy()
    if found is None:
        pytest.skip("py-spy not installed (pip install robust-metrics[sidecar])")
    return found


@contextlib.contextmanager
def python_process() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_live_process_threads_and_frames(py_spy: str) -> None:
    with python_process() as proc:
        (entry,) = dump_stacks([proc.pid])
    assert entry["error"] is None and entry["pid"] == proc.pid
    threads = {t["thread_name"]: t for t in entry["threads"]}
    assert set(threads) == {"MainThread", "helper"}
    main = threads["MainThread"]
    assert main["frames"][0]["function"] == "wait_for_batch"  # innermost first
    assert main["frames"][0]["line"] > 0 and main["idle"] is True
    assert "locals" not in main["frames"][0]
    assert threads["helper"]["frames"][0]["function"] == "helper_loop"


def test_locals_only_when_asked(py_spy: str) -> None:
    with python_process() as proc:
        (entry,) = dump_stacks([proc.pid], locals_=True)
    main = next(t for t in entry["threads"] if t["thread_name"] == "MainThread")
    assert main["frames"][0]["locals"]["secret"].strip("'\"") == "hunter2"


def test_dead_pid_and_non_python_process_give_error_entries(py_spy: str) -> None:
    gone = dead_pid()
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with python_process() as proc:
            entries = dump_stacks([gone, sleeper.pid, proc.pid], timeout=10)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert [e["pid"] for e in entries] == [gone, sleeper.pid, proc.pid]
    assert entries[0]["error"] == f"no such process {gone}" and entries[0]["threads"] == []
    assert entries[1]["error"] and str(sleeper.pid) in entries[1]["error"]
    assert entries[2]["error"] is None and entries[2]["threads"]


def test_py_spy_missing_or_hanging_is_an_error_not_an_exception(
        py_spy: str, tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stacks.PY_SPY_ENV, str(tmp_path) + "/no-such-py-spy")
    (entry,) = dump_stacks([os.getpid()])
    assert "py-spy not found" in entry["error"]
    # a py-spy that never answers is cut off at the deadline
    slow = os.path.join(tmp_path, "py-spy")
    with open(slow, "w") as f:
        f.write("#!/bin/sh\nexec sleep 30\n")
    os.chmod(slow, 0o755)
    monkeypatch.setenv(stacks.PY_SPY_ENV, slow)
    started = time.monotonic()
    entries = dump_stacks([os.getpid(), os.getppid()], timeout=1.0)
    assert time.monotonic() - started < 5
    assert all("timed out" in e["error"] for e in entries)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="positive integer"):
        dump_stacks([0])
    with pytest.raises(ValueError, match="positive integer"):
        dump_stacks(["123"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="timeout"):
        dump_stacks([1], timeout=0)
    assert dump_stacks([]) == []
