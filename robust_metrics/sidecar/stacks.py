"""Python stacks of rank processes, captured from outside with py-spy.

A rank stuck in a collective cannot say where it is, so the stack comes from outside: `py-spy dump`
reads the interpreter's memory without stopping the job for long (tens of milliseconds) and needs no
code in the rank. All pids are dumped concurrently under one deadline, so a node with eight ranks
costs about one dump, and a pid that is gone, a process that is not Python or a py-spy that hangs
gives an error entry for that pid and never an exception: a half-broken node must still report what
it can. The sidecar's `/debug/stacks` and `robust-metrics stacks --pid` both call `dump_stacks`.

Frames are listed innermost first, as py-spy prints them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["PY_SPY_ENV", "dump_stacks", "find_py_spy"]

PY_SPY_ENV = "ROBUST_METRICS_PY_SPY"
"""Environment variable naming the py-spy binary, when it is neither on PATH nor in the venv."""

MAX_PARALLEL = 32
"""At most this many py-spy processes at once; a node rarely has more ranks than that."""

_RETRY_DELAY = 0.2


def find_py_spy() -> str | None:
    """Path of the py-spy binary: $ROBUST_METRICS_PY_SPY, PATH, or next to this Python (a venv)."""
    explicit = os.environ.get(PY_SPY_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else None


def dump_stacks(pids: list[int], native: bool = False, locals_: bool = False,
                timeout: float = 10) -> list[dict[str, Any]]:
    """Dump the Python threads of every pid, concurrently, within `timeout` seconds in total.

    Returns one dict per pid, in the order given: `{pid, threads, error}`. `threads` is a list of
    `{thread_id, os_thread_id, thread_name, idle, frames: [{function, file, line}]}` (frames
    innermost first; with `locals_`, each frame also has `locals`: {name: repr}); `error` is None
    or a one-line reason (no such process, permission denied, timed out, py-spy missing).
    `native` adds C/C++ frames (slower; names them as py-spy does).
    """
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r}: must be a number of seconds > 0")
    clean: list[int] = []
    for pid in pids:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid {pid!r}: must be a positive integer")
        clean.append(pid)
    if not clean:
        return []
    binary = find_py_spy()
    if binary is None:
        reason = (f"py-spy not found (install robust-metrics[sidecar], put it on PATH or set "
                  f"{PY_SPY_ENV})")
        return [_entry(pid, error=reason) for pid in clean]
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(clean))) as pool:
        futures = [pool.submit(_dump_one, binary, pid, native, locals_, deadline) for pid in clean]
        return [f.result() for f in futures]


def _entry(pid: int, threads: list[dict[str, Any]] | None = None,
           error: str | None = None) -> dict[str, Any]:
    return {"pid": pid, "threads": threads or [], "error": error}


def _dump_one(binary: str, pid: int, native: bool, locals_: bool,
              deadline: float) -> dict[str, Any]:
    """One pid; retried once when py-spy fails on a live process (e.g. still starting up)."""
    cmd = [binary, "dump", "--pid", str(pid), "--json"]
    if native:
        cmd.append("--native")
    if locals_:
        cmd.append("--locals")
    error = "not attempted"
    for attempt in range(2):
        if not _alive(pid):
            return _entry(pid, error=f"no such process {pid}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=remaining, check=False)
        except subprocess.TimeoutExpired:
            return _entry(pid, error=f"py-spy timed out on pid {pid}")
        except OSError as exc:
            return _entry(pid, error=f"cannot run {binary}: {exc}")
        if done.returncode == 0:
            try:
                return _entry(pid, threads=_parse(done.stdout, locals_))
            except (ValueError, KeyError, TypeError) as exc:
                return _entry(pid, error=f"unreadable py-spy output for pid {pid}: {exc}")
        error = _first_line(done.stderr) or f"py-spy exited with {done.returncode}"
        if attempt == 0 and deadline - time.monotonic() > _RETRY_DELAY * 2:
            time.sleep(_RETRY_DELAY)
    if not _alive(pid):
        return _entry(pid, error=f"no such process {pid}")
    return _entry(pid, error=f"pid {pid}: {error}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else; py-spy will say what it can do
        return True
    return True


def _first_line(stderr: bytes) -> str:
    for line in stderr.decode(errors="replace").splitlines():
        line = line.strip()
        if line:
            return line.removeprefix("Error: ")
    return ""


def _parse(stdout: bytes, locals_: bool) -> list[dict[str, Any]]:
    """py-spy's JSON (one object per thread) into the documented thread dicts."""
    raw = json.loads(stdout)
    if not isinstance(raw, list):
        raise ValueError("expected a JSON list of threads")
    threads = []
    for t in raw:
        frames = []
        for f in t.get("frames") or []:
            frame: dict[str, Any] = {"function": str(f["name"]), "file": str(f["filename"]),
                                     "line": int(f.get("line") or 0)}
            if locals_:
                frame["locals"] = {str(v.get("name")): v.get("repr") for v in f.get("locals") or []}
            frames.append(frame)
        threads.append({
            "thread_id": t.get("thread_id"),
            "os_thread_id": t.get("os_thread_id"),
            "thread_name": t.get("thread_name") or "",
            "idle": not t.get("active", True),
            "frames": frames,
        })
    return threads
