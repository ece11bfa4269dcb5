"""The ranks' multiprocess folder as the sidecar sees it: live values, dead processes, an archive.

Each rank process writes prometheus_client multiprocess files named by its pid plus
`ranks/<pid>.json` (who it is). A rank that crashes and restarts gets a new pid and new files, so a
plain `MultiProcessCollector` would keep serving the dead pid's gauges (a stale `robust_rank_info`
with the old pid, an old `robust_loss`) forever, and deleting the files would make counters drop.
`RankFolder` does what Prometheus needs instead:

- a pid whose process is gone (or whose pid was reused by a younger process) is dead at once: its
  gauges vanish from the next scrape, all but its global step, which is read once from its last
  files and kept while its identity is (the step a crashed rank reached, though no scrape caught
  its last value alive);
- its counters, summaries and histograms keep counting from its files until they have been quiet for
  `merge_after` seconds; then they are added into `archive/archive.json` and the files are deleted.
  A file is read either live or from the archive, never both, so sums never double and never drop;
  the archive records which files it merged, so a crash between writing it and deleting the files
  cannot count them twice;
- archived values of a run with no live process for `retention` seconds are dropped (the job is
  over), as are the `ranks/<pid>.json` of dead processes;
- a file that cannot be parsed is skipped and counted; a dead pid's corrupt file is moved to
  `archive/corrupt/`.

The folder is written by jobs, so nothing in it is trusted (see `robust_metrics.rankfolder`):
links are never followed, FIFOs and other non-regular files are skipped, each file is read up to
`max_file_bytes` and one scrape reads at most `max_scrape_bytes` in all; files past that budget are
skipped and reported, not read. The archive lives in a sub-folder the sidecar must own.

The quiet period guards against a misconfigured pid namespace (the sidecar cannot see the ranks'
pids): a rank that is still writing keeps its files fresh, so they are never merged away under it.
Only one sidecar owns the archive (an flock); a second one on the same folder serves read-only.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from robust_metrics import schema
from robust_metrics.rankfolder.identity import RANKS_DIR, RankIdentity, pid_of, read_identity
from robust_metrics.rankfolder.layout import prepare
from robust_metrics.rankfolder.metricfile import (
    MAX_FILE_BYTES,
    CorruptFile,
    DbFile,
    Entry,
    parse_key,
    parse_name,
    read_entries,
)
from robust_metrics.rankfolder.safeio import open_dir, read_regular, write_atomic

__all__ = ["FinalProgress", "RankFolder", "RankIdentity", "Snapshot", "process_alive"]

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
_ACCUMULATED = ("counter", "summary", "histogram")
MAX_SCRAPE_BYTES = 64 << 20
"""Bytes of metric files one scrape reads at most; a node of 8 ranks normally reads under 1 MiB."""
MAX_ARCHIVE_BYTES = 256 << 20
_LAST_STEP = schema.LAST_STEP_TIMESTAMP.name
_GLOBAL_STEP = schema.GLOBAL_STEP.name
_START_STEP = schema.START_STEP.name


@dataclass(frozen=True)
class FinalProgress:
    """What a dead process's gauge files said last: the step it reached, the step it started
    from and when it last stepped. A process that crashed before any scrape saw it alive leaves
    only this as proof that it trained, and from where."""

    step: float | None = None
    start_step: float | None = None
    last_step_at: float | None = None


@dataclass
class Snapshot:
    """Everything one scrape needs from the folder, read once and shared by the collectors."""

    taken: float
    families: list[Metric]
    identities: dict[int, RankIdentity]
    alive: dict[int, bool]
    last_step: dict[tuple[str, str], float]
    corrupt_total: int
    errors: list[str] = field(default_factory=list)
    final: dict[int, FinalProgress] = field(default_factory=dict)  # pid -> progress at its exit
    written: dict[int, float] = field(default_factory=dict)  # pid -> last write of its files


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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


class _OverBudget(Exception):
    """A file left unread because this scrape has read its byte budget."""


class _Archive:
    """Values of merged dead files, persisted as JSON in `archive/`, a folder this sidecar owns.

    Every access goes through a descriptor of that folder opened without following links, and
    the folder must belong to the sidecar's user: a job that planted `archive/` (or a link at
    `archive/archive.json.tmp`) beforehand gets a read-only sidecar, not a write outside the folder.
    """

    def __init__(self, directory: str) -> None:
        self.folder = os.path.join(directory, "archive")
        self.path = os.path.join(self.folder, "archive.json")
        self.values: dict[tuple[str, str], float] = {}
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


class _Accumulator:
    """Merges samples the way prometheus_client's MultiProcessCollector does, file by file."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}  # metric -> (type, help)
        self.values: dict[str, dict[tuple[str, Labels], float]] = defaultdict(dict)
        self.stamps: dict[tuple[str, str, Labels], float] = {}

    def add(self, typ: str, mode: str, pid: int, metric: str, sample: str, labels: Labels,
            help_text: str, value: float, timestamp: float) -> None:
        self.meta.setdefault(metric, (typ, help_text))
        values = self.values[metric]
        if typ != "gauge":
            key = (sample, labels)
            values[key] = values.get(key, 0.0) + value
            return
        mode = mode.removeprefix("live")
        if mode == "all":
            key = (sample, (*labels, ("pid", str(pid))))
            values[key] = value
        elif mode == "sum":
            key = (sample, labels)
            values[key] = values.get(key, 0.0) + value
        elif mode in ("max", "min"):
            key = (sample, labels)
            current = values.get(key)
            if current is None or (value > current if mode == "max" else value < current):
                values[key] = value
        else:  # mostrecent, the rank hook's mode
            key = (sample, labels)
            stamp_key = (metric, sample, labels)
            if key not in values or timestamp > self.stamps[stamp_key]:
                values[key] = value
                self.stamps[stamp_key] = timestamp

    def families(self) -> list[Metric]:
        out = []
        for metric, values in self.values.items():
            typ, help_text = self.meta[metric]
            family = Metric(metric, help_text, typ)
            if typ == "histogram":
                self._add_histogram(family, values)
            else:
                for (sample, labels), value in values.items():
                    family.add_sample(sample, dict(labels), value)
            out.append(family)
        return out

    @staticmethod
    def _add_histogram(family: Metric, values: dict[tuple[str, Labels], float]) -> None:
        buckets: dict[Labels, dict[float, float]] = defaultdict(dict)
        for (sample, labels), value in values.items():
            le = dict(labels).get("le")
            if le is None:
                if not sample.endswith("_count"):
                    family.add_sample(sample, dict(labels), value)
                continue
            rest = tuple(kv for kv in labels if kv[0] != "le")
            bound = float(le)
            buckets[rest][bound] = buckets[rest].get(bound, 0.0) + value
        for labels, by_bound in buckets.items():
            total = 0.0
            for bound, value in sorted(by_bound.items()):
                total += value
                family.add_sample(f"{family.name}_bucket",
                                  {**dict(labels), "le": floatToGoString(bound)}, total)
            family.add_sample(f"{family.name}_count", dict(labels), total)


class RankFolder:
    """Reads the ranks' folder into a `Snapshot`; the owner also reaps dead processes' files."""

    def __init__(self, directory: str, *, merge_after: float = 60.0, retention: float = 600.0,
                 cache_seconds: float = 0.25,
                 alive: Callable[[int, float | None], bool] = process_alive,
                 max_file_bytes: int = MAX_FILE_BYTES,
                 max_scrape_bytes: int = MAX_SCRAPE_BYTES) -> None:
        self.directory = directory
        self.max_file_bytes = max_file_bytes
        self.max_scrape_bytes = max_scrape_bytes
        self._budget = max_scrape_bytes
        self.merge_after = merge_after
        self.retention = retention
        self.cache_seconds = cache_seconds
        self._alive = alive
        self._lock = threading.Lock()
        # The scrape's pinned snapshot: a context variable, which the scrape's collector threads
        # inherit (ScrapeRegistry runs each collector in its scrape's context).
        self._pinned: contextvars.ContextVar[Snapshot | None] = contextvars.ContextVar(
            f"robust_metrics_snapshot_{id(self)}", default=None)
        self._snapshot: Snapshot | None = None
        self._snapshot_at = 0.0
        self._archive = _Archive(directory)
        self._key_cache: dict[str, tuple[str, str, Labels, str]] = {}
        self._identity_cache: dict[str, tuple[int, RankIdentity | None]] = {}
        self._corrupt_seen: set[tuple[str, int]] = set()
        self._dead_since: dict[int, float] = {}
        self._final: dict[int, FinalProgress] = {}
        prepare(directory)
        self._archive.acquire()
        self._archive.load_if_changed()

    @property
    def owner(self) -> bool:
        """Whether this sidecar merges and deletes dead files (it holds the archive lock)."""
        return self._archive.owner

    def close(self) -> None:
        self._archive.release()

    def snapshot(self) -> Snapshot:
        """The folder's state, at most `cache_seconds` old; concurrent scrapes share one read.
        Inside `one_scrape()` the same snapshot every time, however old."""
        pinned = self._pinned.get()
        if pinned is not None:
            return pinned
        with self._lock:
            now = time.monotonic()
            if self._snapshot is None or now - self._snapshot_at >= self.cache_seconds:
                self._snapshot = self._read()
                self._snapshot_at = time.monotonic()
            return self._snapshot

    @contextlib.contextmanager
    def one_scrape(self) -> Iterator[Snapshot]:
        """Pin one snapshot for every `snapshot()` of this context (this thread, and the threads
        that run the scrape's collectors in it) until the block ends. The
        collectors of one scrape each ask for the folder's state; without the pin, the cache
        could expire between two of them, and a scrape would show a restarted rank's new steps
        beside its dead predecessor's liveness."""
        pinned = self._pinned.get() or self.snapshot()
        token = self._pinned.set(pinned)
        try:
            yield pinned
        finally:
            self._pinned.reset(token)

    # -- reading ---------------------------------------------------------------------------
    def _read(self) -> Snapshot:
        now = time.time()
        errors: list[str] = []
        archive = self._archive
        if not archive.owner:
            archive.load_if_changed()
        self._budget = self.max_scrape_bytes
        files: dict[int, list[DbFile]] = defaultdict(list)
        written: dict[int, float] = {}
        with os.scandir(self.directory) as it:
            for entry in it:
                db = parse_name(self.directory, entry.name)
                if db is not None and entry.is_file(follow_symlinks=False):
                    files[db.pid].append(db)
                    with contextlib.suppress(OSError):
                        mtime = entry.stat(follow_symlinks=False).st_mtime
                        written[db.pid] = max(mtime, written.get(db.pid, mtime))
        # After the metric files: a rank writes its identity before them, so every rank whose
        # files were seen has its identity seen too. Read the other way round, a rank started
        # between the two scans would show its metrics beside only its dead predecessor's
        # identity, which reads as the rank not alive.
        identities = self._identities()
        pids = set(files) | set(identities)
        alive = {}
        for pid in pids:
            ident = identities.get(pid)
            alive[pid] = self._alive(pid, ident.started if ident else None)
            if alive[pid]:
                self._dead_since.pop(pid, None)
            else:
                self._dead_since.setdefault(pid, now)
        live_runs = {ident.run for pid, ident in identities.items() if alive[pid]}
        self._keep_final_steps(files, alive, pids, errors)
        acc = _Accumulator()
        to_delete: list[str] = []
        merged_pids = set()
        for pid, dbs in files.items():
            if not alive[pid] and archive.owner and self._quiet(dbs, now):
                to_delete += self._merge(dbs, now, errors)
                merged_pids.add(pid)
        if to_delete:
            try:
                archive.save()  # before deleting: a crash in between must not lose or double counts
            except OSError as exc:
                errors.append(f"cannot save the archive, dead files stay: {exc}")
                archive.load_if_changed(force=True)  # roll back to what is on disk
                to_delete, merged_pids = [], set()
        for path in to_delete:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for pid, dbs in files.items():
            if pid in merged_pids:
                continue
            for db in dbs:
                if not alive[pid] and db.type == "gauge":
                    continue  # a dead process's gauges vanish at once
                for (metric, sample, labels, help_text), entry in self._read_file(db, errors):
                    acc.add(db.type, db.mode, pid, metric, sample, labels, help_text,
                            entry.value, entry.timestamp)
                    if alive[pid] and db.type != "gauge":
                        live_runs.update(v for k, v in labels if k == "run")
        if archive.owner:
            if self._expire(live_runs, now):
                try:
                    archive.save()
                except OSError as exc:
                    errors.append(f"cannot save the archive: {exc}")
            self._reap_identities(identities, alive, now)
        for (typ, key), value in archive.values.items():
            try:
                metric, sample, labels, help_text = self._parse_key(key)
            except CorruptFile:
                continue
            acc.add(typ, "", 0, metric, sample, labels, help_text, value, 0.0)
        families = acc.families()
        last_step = {}
        for family in families:
            if family.name == _LAST_STEP:
                for s in family.samples:
                    last_step[(s.labels.get("run", ""), s.labels.get("rank", ""))] = s.value
        final = {pid: progress for pid, progress in self._final.items()
                 if progress.step is not None}
        return Snapshot(now, families, identities, alive, last_step, len(self._corrupt_seen),
                        errors, final, written)

    def _keep_final_steps(self, files: dict[int, list[DbFile]], alive: dict[int, bool],
                          pids: set[int], errors: list[str]) -> None:
        """Read each newly dead pid's progress from its gauge files once, before a merge
        deletes them (a pid without a step is not read again); forget pids that left the
        folder."""
        for pid in set(self._final) - pids:
            del self._final[pid]
        wanted = (_GLOBAL_STEP, _START_STEP, _LAST_STEP)
        for pid, dbs in files.items():
            if alive[pid] or pid in self._final:
                continue
            values: dict[str, list[float]] = defaultdict(list)
            for db in dbs:
                if db.type != "gauge":
                    continue
                for (metric, _, _, _), entry in self._read_file(db, errors):
                    if metric in wanted:
                        values[metric].append(entry.value)
            step, start, last = (max(values[m]) if values[m] else None for m in wanted)
            self._final[pid] = FinalProgress(step, start, last if last else None)

    def _identities(self) -> dict[int, RankIdentity]:
        found: dict[int, RankIdentity] = {}
        seen = set()
        try:
            fd = open_dir(os.path.join(self.directory, RANKS_DIR))
        except FileNotFoundError:
            return found
        except OSError as exc:
            log.warning("cannot read %s/%s: %s", self.directory, RANKS_DIR, exc)
            return found
        try:
            for entry in os.scandir(fd):
                name = entry.name
                if pid_of(name) is None or not entry.is_file(follow_symlinks=False):
                    continue
                seen.add(name)
                try:
                    mtime = entry.stat(follow_symlinks=False).st_mtime_ns
                except FileNotFoundError:
                    continue
                cached = self._identity_cache.get(name)
                if cached is None or cached[0] != mtime:
                    cached = (mtime, self._load_identity(name, fd))
                    self._identity_cache[name] = cached
                if cached[1] is not None:
                    found[cached[1].pid] = cached[1]
        finally:
            os.close(fd)
        for name in set(self._identity_cache) - seen:
            del self._identity_cache[name]
        return found

    def _load_identity(self, name: str, ranks_fd: int) -> RankIdentity | None:
        try:
            return read_identity(name, ranks_fd)
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable rank identity %s/%s/%s: %s", self.directory,
                        RANKS_DIR, name, exc)
            return None

    def _parse_key(self, key: str) -> tuple[str, str, Labels, str]:
        parsed = self._key_cache.get(key)
        if parsed is None:
            parsed = parse_key(key)
            if len(self._key_cache) > 200_000:
                self._key_cache.clear()
            self._key_cache[key] = parsed
        return parsed

    def _read_file(self, db: DbFile, errors: list[str]
                   ) -> list[tuple[tuple[str, str, Labels, str], Entry]]:
        """The file's parsed entries, or none at all when any part of it is corrupt."""
        try:
            return [(self._parse_key(e.key), e) for e in self._entries(db)]
        except FileNotFoundError:
            return []  # merged or removed between listing and reading
        except _OverBudget as exc:
            errors.append(str(exc))
            return []
        except (CorruptFile, OSError) as exc:
            self._count_corrupt(db, str(exc), errors)
            return []

    def _entries(self, db: DbFile) -> list[Entry]:
        """`read_entries` within what is left of this scrape's byte budget."""
        if self._budget <= 0:
            raise _OverBudget(f"{os.path.basename(db.path)}: not read, this scrape already read "
                              f"{self.max_scrape_bytes} bytes")
        entries = read_entries(db.path, self.max_file_bytes)
        self._budget -= sum(len(e.key) + 24 for e in entries) + 8
        return entries

    def _count_corrupt(self, db: DbFile, reason: str, errors: list[str]) -> None:
        try:
            ident = (db.path, os.stat(db.path, follow_symlinks=False).st_ino)
        except OSError:
            ident = (db.path, 0)
        if ident not in self._corrupt_seen:
            self._corrupt_seen.add(ident)
            log.warning("skipping corrupt metrics file %s: %s", db.path, reason)
        errors.append(f"{os.path.basename(db.path)}: {reason}")

    # -- reaping ---------------------------------------------------------------------------
    def _quiet(self, dbs: list[DbFile], now: float) -> bool:
        newest = 0.0
        for db in dbs:
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(db.path, follow_symlinks=False).st_mtime)
        return now - newest >= self.merge_after

    @staticmethod
    def _file_identity(db: DbFile) -> str | None:
        try:
            st = os.stat(db.path, follow_symlinks=False)
        except OSError:
            return None
        return f"{os.path.basename(db.path)}:{st.st_ino}:{st.st_size}"

    def _merge(self, dbs: list[DbFile], now: float, errors: list[str]) -> list[str]:
        """Add a dead process's accumulating values to the archive (in memory); return the files
        to delete once the archive is saved."""
        archive = self._archive
        to_delete = []
        for db in dbs:
            ident = self._file_identity(db)
            if ident is None:
                continue
            if ident in archive.merged or db.type == "gauge":
                to_delete.append(db.path)
                continue
            try:
                parsed = [(self._parse_key(e.key), e) for e in self._entries(db)]
            except FileNotFoundError:
                continue
            except _OverBudget as exc:
                errors.append(str(exc))
                continue
            except (CorruptFile, OSError) as exc:
                self._count_corrupt(db, str(exc), errors)
                self._quarantine(db)
                continue
            for (_, _, labels, _), entry in parsed:
                key = (db.type, entry.key)
                archive.values[key] = archive.values.get(key, 0.0) + entry.value
                for k, v in labels:
                    if k == "run":
                        archive.run_seen[v] = now
            archive.merged[ident] = now
            to_delete.append(db.path)
        return to_delete

    def _quarantine(self, db: DbFile) -> None:
        self._archive.quarantine(db.path)

    def _expire(self, live_runs: set[str], now: float) -> bool:
        archive = self._archive
        for run in live_runs:
            archive.run_seen[run] = now
        expired = {run for run, seen in archive.run_seen.items()
                   if run not in live_runs and now - seen >= self.retention}
        changed = False
        if expired:
            for key in list(archive.values):
                try:
                    labels = dict(self._parse_key(key[1])[2])
                except CorruptFile:
                    labels = {}
                if labels.get("run") in expired:
                    del archive.values[key]
            for run in expired:
                del archive.run_seen[run]
            changed = True
        # merged identities only guard against a crash between save and unlink
        old = [k for k, t in archive.merged.items() if now - t > max(self.retention, 3600.0)]
        for k in old:
            del archive.merged[k]
        return changed or bool(old)

    def _unlink_identity(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            fd = open_dir(os.path.join(self.directory, RANKS_DIR))
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{pid}.json", dir_fd=fd)
            finally:
                os.close(fd)

    def _reap_identities(self, identities: dict[int, RankIdentity], alive: dict[int, bool],
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
