"""Which processes still run, and what is kept and removed of those that do not, as
prometheus_client's `mark_process_dead` does apart from its merge.

A pid whose process is gone, or whose pid now belongs to a younger process, is dead at once. Its
gauges vanish from the next scrape (see `merge`), all but its progress: the global step, start step
and last step time are read once from its last gauge files and kept while its identity is (the step
a crashed rank reached, though no scrape caught its last value alive). Its `ranks/<pid>.json` is
removed once a newer process of the same run and rank has one, or after `retention` seconds dead.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Callable

import psutil

from robust_metrics import schema
from robust_metrics.rankfolder.identity import RANKS_DIR, RankIdentity
from robust_metrics.rankfolder.metricfile import DbFile
from robust_metrics.rankfolder.safeio import open_dir
from robust_metrics.sidecar.rank_files.scan import FileReader
from robust_metrics.sidecar.rank_files.snapshot import FinalProgress

__all__ = ["Liveness", "process_alive"]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROGRESS = (schema.GLOBAL_STEP.name, schema.START_STEP.name, schema.LAST_STEP_TIMESTAMP.name)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (one read, no psutil objects)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rfind(b")") + 2:].decode().split()


def process_alive(pid: int, started: float | None = None) -> bool:
    """True while `pid` runs and is the process that wrote its identity (not a reused pid)."""
    if os.path.isdir("/proc/self"):  # Linux fast path: state and start time from one read
        try:
            fields = _stat_fields(pid)
        except OSError:
            return True  # exists but unreadable
        if fields is None or fields[0] in ("Z", "X"):
            return False
        if started is None:
            return True
        created = psutil.boot_time() + int(fields[19]) / _CLOCK_TICKS
        return created <= started + 2.0  # created later: another process with a reused pid
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not (started is not None and proc.create_time() > started + 2.0)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


class Liveness:
    """Since when each dead pid is dead and the progress it reached; reaps dead identities.

    `alive(pid, started)` says whether a process runs (`process_alive`; tests inject their own).
    """

    def __init__(self, directory: str, alive: Callable[[int, float | None], bool],
                 retention: float) -> None:
        self.directory = directory
        self.retention = retention
        self._alive = alive
        self._dead_since: dict[int, float] = {}
        self._final: dict[int, FinalProgress] = {}

    def observe(self, pids: set[int], identities: dict[int, RankIdentity],
                now: float) -> dict[int, bool]:
        """Whether each pid runs, asked once per read; a dead pid's death is dated the first
        time it is seen dead."""
        alive = {}
        for pid in pids:
            ident = identities.get(pid)
            alive[pid] = self._alive(pid, ident.started if ident else None)
            if alive[pid]:
                self._dead_since.pop(pid, None)
            else:
                self._dead_since.setdefault(pid, now)
        return alive

    def keep_final_steps(self, files: dict[int, list[DbFile]], alive: dict[int, bool],
                         pids: set[int], reader: FileReader, errors: list[str]) -> None:
        """Read each newly dead pid's progress from its gauge files once, before an archive
        deletes them (a pid without a step is not read again); forget pids that left the
        folder."""
        for pid in set(self._final) - pids:
            del self._final[pid]
        for pid, dbs in files.items():
            if not alive[pid] and pid not in self._final:
                self._final[pid] = _progress(dbs, reader, errors)

    def final(self) -> dict[int, FinalProgress]:
        """The progress of the dead pids that reached a step."""
        return {pid: progress for pid, progress in self._final.items()
                if progress.step is not None}

    def reap_identities(self, identities: dict[int, RankIdentity], alive: dict[int, bool],
                        now: float) -> None:
        """Remove `ranks/<pid>.json` of dead processes once superseded or past retention."""
        newest: dict[tuple[str, str], float] = {}
        for ident in identities.values():
            key = (ident.run, ident.rank)
            newest[key] = max(newest.get(key, 0.0), ident.started or 0.0)
        for pid, ident in identities.items():
            if alive.get(pid, True):
                continue
            superseded = (ident.started or 0.0) < newest[(ident.run, ident.rank)]
            if superseded or now - self._dead_since.get(pid, now) >= self.retention:
                self._unlink_identity(pid)
                self._dead_since.pop(pid, None)

    def _unlink_identity(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            fd = open_dir(os.path.join(self.directory, RANKS_DIR))
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{pid}.json", dir_fd=fd)
            finally:
                os.close(fd)


def _progress(dbs: list[DbFile], reader: FileReader, errors: list[str]) -> FinalProgress:
    """The highest global step, start step and last step time in a process's gauge files."""
    values: dict[str, list[float]] = defaultdict(list)
    for db in dbs:
        if db.type != "gauge":
            continue
        for (metric, _, _, _), entry in reader.read(db, errors):
            if metric in _PROGRESS:
                values[metric].append(entry.value)
    step, start, last = (max(values[m]) if values[m] else None for m in _PROGRESS)
    return FinalProgress(step, start, last if last else None)
