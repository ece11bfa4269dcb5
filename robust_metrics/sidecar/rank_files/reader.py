"""`RankFiles`: one read of the ranks' folder, in order, cached and pinned for a scrape.

The order of a read matters: the metric files are listed before the identities (a rank writes its
identity first), liveness is asked once, a dead pid's progress is kept before its files can be
archived, files are archived and deleted before the rest is merged live, and only the archive's
owner expires runs and reaps identities. Each step is in its own module; this one keeps the order
and the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator

from robust_metrics.rankfolder.identity import RankIdentity
from robust_metrics.rankfolder.layout import prepare
from robust_metrics.rankfolder.metricfile import MAX_FILE_BYTES
from robust_metrics.sidecar.rank_files.archive import Archive, archive_dead, expire
from robust_metrics.sidecar.rank_files.liveness import Liveness, process_alive
from robust_metrics.sidecar.rank_files.merge import Accumulator, last_steps, merge_live
from robust_metrics.sidecar.rank_files.scan import (
    MAX_SCRAPE_BYTES,
    FileReader,
    IdentityScan,
    scan_metric_files,
)
from robust_metrics.sidecar.rank_files.snapshot import Snapshot

__all__ = ["RankFiles"]


class RankFiles:
    """Reads the ranks' folder into a `Snapshot`; the owner also archives and reaps dead
    processes' files."""

    def __init__(self, directory: str, *, merge_after: float = 60.0, retention: float = 600.0,
                 cache_seconds: float = 0.25,
                 alive: Callable[[int, float | None], bool] = process_alive,
                 max_file_bytes: int = MAX_FILE_BYTES,
                 max_scrape_bytes: int = MAX_SCRAPE_BYTES) -> None:
        self.directory = directory
        self.merge_after = merge_after
        self.retention = retention
        self.cache_seconds = cache_seconds
        self._lock = threading.Lock()
        # The scrape's pinned snapshot: a context variable, which the scrape's collector threads
        # inherit (ScrapeRegistry runs each collector in its scrape's context).
        self._pinned: contextvars.ContextVar[Snapshot | None] = contextvars.ContextVar(
            f"robust_metrics_snapshot_{id(self)}", default=None)
        self._snapshot: Snapshot | None = None
        self._snapshot_at = 0.0
        self._archive = Archive(directory)
        self._reader = FileReader(max_file_bytes, max_scrape_bytes)
        self._identity_scan = IdentityScan(directory)
        self._liveness = Liveness(directory, alive, retention)
        prepare(directory)
        self._archive.acquire()
        self._archive.load_if_changed()

    @property
    def owner(self) -> bool:
        """Whether this sidecar archives and deletes dead files (it holds the archive lock)."""
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

    def _identities(self) -> dict[int, RankIdentity]:
        return self._identity_scan()

    def _read(self) -> Snapshot:
        now = time.time()
        errors: list[str] = []
        if not self._archive.owner:
            self._archive.load_if_changed()
        self._reader.start_scrape()
        files, written = scan_metric_files(self.directory)
        # After the metric files: a rank writes its identity before them, so every rank whose
        # files were seen has its identity seen too. Read the other way round, a rank started
        # between the two scans would show its metrics beside only its dead predecessor's
        # identity, which reads as the rank not alive.
        identities = self._identities()
        pids = set(files) | set(identities)
        alive = self._liveness.observe(pids, identities, now)
        live_runs = {ident.run for pid, ident in identities.items() if alive[pid]}
        self._liveness.keep_final_steps(files, alive, pids, self._reader, errors)
        archived = archive_dead(self._archive, files, alive, self._reader, now,
                                self.merge_after, errors)
        acc = Accumulator()
        live_runs |= merge_live(acc, files, alive, archived, self._reader, errors)
        if self._archive.owner:
            self._expire(live_runs, now, errors)
            self._liveness.reap_identities(identities, alive, now)
        acc.add_archived(self._archive.values, self._reader.parse_key)
        families = acc.families()
        return Snapshot(now, families, identities, alive, last_steps(families),
                        self._reader.corrupt_total, errors, self._liveness.final(), written)

    def _expire(self, live_runs: set[str], now: float, errors: list[str]) -> None:
        if expire(self._archive, live_runs, now, self.retention, self._reader):
            try:
                self._archive.save()
            except OSError as exc:
                errors.append(f"cannot save the archive: {exc}")
