"""The archive: what dead processes counted, kept after their files are deleted.

A dead process's counters, summaries and histograms keep counting from its files until they have
been quiet for `merge_after` seconds; then they are added into `archive/archive.json` and the files
are deleted (its gauge files too: they were no longer served). A file is read either live or from
the archive, never both, so sums never double and never drop; the archive is saved before the files
are deleted and records which files it merged, so a crash in between cannot count them twice.
Archived values of a run with no live process for `retention` seconds are dropped (the job is
over). A dead pid's corrupt file is moved to `archive/corrupt/`.

The quiet period guards against a misconfigured pid namespace (the sidecar cannot see the ranks'
pids): a rank that is still writing keeps its files fresh, so they are never archived under it.
Only one sidecar owns the archive (an flock); a second one on the same folder serves read-only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time

from robust_metrics.rankfolder.metricfile import CorruptFile, DbFile, Entry
from robust_metrics.rankfolder.safeio import open_dir, read_regular, write_atomic
from robust_metrics.sidecar.rank_files.scan import FileReader, OverBudget, Parsed

__all__ = ["MAX_ARCHIVE_BYTES", "Archive", "archive_dead", "expire"]

log = logging.getLogger(__name__)

MAX_ARCHIVE_BYTES = 256 << 20
_MERGED_KEPT = 3600.0
"""Seconds a merged file's identity is kept at least (it only guards a crash between save and
unlink)."""


class Archive:
    """Values of merged dead files, persisted as JSON in `archive/`, a folder this sidecar owns.

    Every access goes through a descriptor of that folder opened without following links, and
    the folder must belong to the sidecar's user: a job that planted `archive/` (or a link at
    `archive/archive.json.tmp`) beforehand gets a read-only sidecar, not a write outside the folder.
    """

    def __init__(self, directory: str) -> None:
        self.folder = os.path.join(directory, "archive")
        self.path = os.path.join(self.folder, "archive.json")
        self.values: dict[tuple[str, str], float] = {}  # (type, key) -> value
        self.merged: dict[str, float] = {}  # file identity -> when merged
        self.run_seen: dict[str, float] = {}  # run -> last time it had a live or merged process
        self.owner = False
        self._fd: int | None = None
        self._lock_file: int | None = None
        self._loaded_mtime = -1

    def _folder_fd(self) -> int | None:
        if self._fd is None:
            try:
                fd = open_dir(self.folder, create=True, mode=0o700)
            except OSError as exc:
                log.error("cannot use %s (%s); serving the folder read-only", self.folder, exc)
                return None
            if os.fstat(fd).st_uid != os.geteuid():
                os.close(fd)
                log.error("%s belongs to another user; serving the folder read-only",
                          self.folder)
                return None
            os.fchmod(fd, 0o700)  # the sidecar's private state
            self._fd = fd
        return self._fd

    def acquire(self) -> bool:
        """Take the archive's lock; without it this sidecar serves the folder read-only."""
        afd = self._folder_fd()
        if afd is None:
            return False
        fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=afd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            log.warning("another sidecar owns %s; serving it read-only", self.folder)
            return False
        self._lock_file = fd
        self.owner = True
        return True

    def release(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None
            self.owner = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def load_if_changed(self, force: bool = False) -> None:
        """Read `archive.json` again when it changed on disk (or always, with `force`: a roll
        back to what is on disk)."""
        afd = self._folder_fd()
        try:
            if afd is None:
                raise FileNotFoundError(self.path)
            mtime = os.stat("archive.json", dir_fd=afd, follow_symlinks=False).st_mtime_ns
        except FileNotFoundError:
            if force:
                self.values, self.merged, self.run_seen = {}, {}, {}
            return
        if mtime == self._loaded_mtime and not force:
            return
        try:
            data = json.loads(read_regular("archive.json", MAX_ARCHIVE_BYTES, afd))
            self.values = {(t, k): float(v) for t, k, v in data.get("values", [])}
            self.merged = {str(k): float(v) for k, v in data.get("merged", {}).items()}
            self.run_seen = {str(k): float(v) for k, v in data.get("runs", {}).items()}
            self._loaded_mtime = mtime
        except (OSError, ValueError, TypeError, AttributeError, OverflowError) as exc:
            log.error("cannot read the archive %s (%s); starting a new one", self.path, exc)
            self._loaded_mtime = mtime

    def save(self) -> None:
        afd = self._folder_fd()
        if afd is None:
            raise OSError(f"{self.folder} is not usable")
        body = json.dumps({"version": 1,
                           "values": [[t, k, v] for (t, k), v in self.values.items()],
                           "merged": self.merged, "runs": self.run_seen}).encode()
        write_atomic("archive.json", body, afd)
        self._loaded_mtime = os.stat("archive.json", dir_fd=afd,
                                     follow_symlinks=False).st_mtime_ns

    def add(self, typ: str, parsed: list[tuple[Parsed, Entry]], now: float) -> None:
        """Add one file's values (in memory) and mark its runs as seen now."""
        for (_, _, labels, _), entry in parsed:
            key = (typ, entry.key)
            self.values[key] = self.values.get(key, 0.0) + entry.value
            for k, v in labels:
                if k == "run":
                    self.run_seen[v] = now

    def quarantine(self, path: str) -> None:
        """Move a corrupt file into `archive/corrupt/` (rename moves the name, never a target)."""
        afd = self._folder_fd()
        if afd is None:
            return
        with contextlib.suppress(OSError):
            cfd = open_dir("corrupt", afd, create=True)
            try:
                os.replace(path, f"{int(time.time())}_{os.path.basename(path)}", dst_dir_fd=cfd)
            finally:
                os.close(cfd)


def archive_dead(archive: Archive, files: dict[int, list[DbFile]], alive: dict[int, bool],
                 reader: FileReader, now: float, merge_after: float,
                 errors: list[str]) -> set[int]:
    """Archive the files of dead pids quiet for `merge_after` seconds, save, then delete them;
    return the pids archived (none when the archive could not be saved: their files stay and
    are read live). Only the archive's owner archives."""
    to_delete: list[str] = []
    archived = set()
    for pid, dbs in files.items():
        if not alive[pid] and archive.owner and _quiet(dbs, now, merge_after):
            to_delete += _absorb(archive, dbs, reader, now, errors)
            archived.add(pid)
    if to_delete:
        try:
            archive.save()  # before deleting: a crash in between must not lose or double counts
        except OSError as exc:
            errors.append(f"cannot save the archive, dead files stay: {exc}")
            archive.load_if_changed(force=True)  # roll back to what is on disk
            to_delete, archived = [], set()
    for path in to_delete:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return archived


def _quiet(dbs: list[DbFile], now: float, merge_after: float) -> bool:
    newest = 0.0
    for db in dbs:
        with contextlib.suppress(OSError):
            newest = max(newest, os.stat(db.path, follow_symlinks=False).st_mtime)
    return now - newest >= merge_after


def _file_identity(db: DbFile) -> str | None:
    try:
        st = os.stat(db.path, follow_symlinks=False)
    except OSError:
        return None
    return f"{os.path.basename(db.path)}:{st.st_ino}:{st.st_size}"


def _absorb(archive: Archive, dbs: list[DbFile], reader: FileReader, now: float,
            errors: list[str]) -> list[str]:
    """Add a dead process's accumulating values to the archive (in memory); return the files
    to delete once the archive is saved."""
    to_delete = []
    for db in dbs:
        ident = _file_identity(db)
        if ident is None:
            continue
        if ident in archive.merged or db.type == "gauge":
            to_delete.append(db.path)
            continue
        parsed = _read_or_quarantine(archive, db, reader, errors)
        if parsed is None:
            continue
        archive.add(db.type, parsed, now)
        archive.merged[ident] = now
        to_delete.append(db.path)
    return to_delete


def _read_or_quarantine(archive: Archive, db: DbFile, reader: FileReader,
                        errors: list[str]) -> list[tuple[Parsed, Entry]] | None:
    """The file's parsed entries; None when it is gone, past the budget, or corrupt (then
    counted and moved into `archive/corrupt/`)."""
    try:
        return reader.parsed(db)
    except FileNotFoundError:
        return None
    except OverBudget as exc:
        errors.append(str(exc))
        return None
    except (CorruptFile, OSError) as exc:
        reader.count_corrupt(db, str(exc), errors)
        archive.quarantine(db.path)
        return None


def expire(archive: Archive, live_runs: set[str], now: float, retention: float,
           reader: FileReader) -> bool:
    """Drop the values of runs without a live process for `retention` seconds and the merged
    files' identities past their use; whether anything changed (then the archive needs a save)."""
    for run in live_runs:
        archive.run_seen[run] = now
    expired = {run for run, seen in archive.run_seen.items()
               if run not in live_runs and now - seen >= retention}
    if expired:
        _drop_runs(archive, expired, reader)
    old = [k for k, t in archive.merged.items() if now - t > max(retention, _MERGED_KEPT)]
    for k in old:
        del archive.merged[k]
    return bool(expired) or bool(old)


def _drop_runs(archive: Archive, runs: set[str], reader: FileReader) -> None:
    for key in list(archive.values):
        try:
            labels = dict(reader.parse_key(key[1])[2])
        except CorruptFile:
            labels = {}
        if labels.get("run") in runs:
            del archive.values[key]
    for run in runs:
        del archive.run_seen[run]
