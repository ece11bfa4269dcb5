"""Listing the ranks' folder and reading its files within bounds; nothing here decides.

The folder is written by jobs, so nothing in it is trusted (see `robust_metrics.rankfolder`): links
are never followed and FIFOs and other non-regular files are skipped (`rankfolder.safeio`), each
metric file is read up to `max_file_bytes`, and one scrape reads at most `max_scrape_bytes` in all:
files past that budget are left unread and reported, not read. A file that cannot be parsed is
skipped whole and counted once (`robust_sidecar_corrupt_files_total`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict

from robust_metrics.rankfolder.identity import RANKS_DIR, RankIdentity, pid_of, read_identity
from robust_metrics.rankfolder.metricfile import (
    MAX_FILE_BYTES,
    CorruptFile,
    DbFile,
    Entry,
    parse_key,
    parse_name,
    read_entries,
)
from robust_metrics.rankfolder.safeio import open_dir
from robust_metrics.sidecar.rank_files.snapshot import Labels

__all__ = ["MAX_SCRAPE_BYTES", "FileReader", "IdentityScan", "OverBudget", "Parsed",
           "scan_metric_files"]

log = logging.getLogger(__name__)

MAX_SCRAPE_BYTES = 64 << 20
"""Bytes of metric files one scrape reads at most; a node of 8 ranks normally reads under 1 MiB."""

Parsed = tuple[str, str, Labels, str]
"""A parsed entry key: metric, sample name, labels, help text."""


def scan_metric_files(directory: str) -> tuple[dict[int, list[DbFile]], dict[int, float]]:
    """The folder's metric files by pid (regular files only), and each pid's last write (the
    newest modification time of its files)."""
    files: dict[int, list[DbFile]] = defaultdict(list)
    written: dict[int, float] = {}
    with os.scandir(directory) as it:
        for entry in it:
            db = parse_name(directory, entry.name)
            if db is not None and entry.is_file(follow_symlinks=False):
                files[db.pid].append(db)
                with contextlib.suppress(OSError):
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                    written[db.pid] = max(mtime, written.get(db.pid, mtime))
    return files, written


class IdentityScan:
    """`ranks/<pid>.json` of every process in the folder; a file is parsed again only when its
    modification time changes, and forgotten when it is gone."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._cache: dict[str, tuple[int, RankIdentity | None]] = {}

    def __call__(self) -> dict[int, RankIdentity]:
        try:
            fd = open_dir(os.path.join(self.directory, RANKS_DIR))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("cannot read %s/%s: %s", self.directory, RANKS_DIR, exc)
            return {}
        try:
            found, seen = self._scan(fd)
        finally:
            os.close(fd)
        for name in set(self._cache) - seen:
            del self._cache[name]
        return found

    def _scan(self, fd: int) -> tuple[dict[int, RankIdentity], set[str]]:
        found: dict[int, RankIdentity] = {}
        seen = set()
        for entry in os.scandir(fd):
            name = entry.name
            if pid_of(name) is None or not entry.is_file(follow_symlinks=False):
                continue
            seen.add(name)
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:
                continue
            cached = self._cache.get(name)
            if cached is None or cached[0] != mtime:
                cached = (mtime, self._load(name, fd))
                self._cache[name] = cached
            if cached[1] is not None:
                found[cached[1].pid] = cached[1]
        return found, seen

    def _load(self, name: str, ranks_fd: int) -> RankIdentity | None:
        try:
            return read_identity(name, ranks_fd)
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable rank identity %s/%s/%s: %s", self.directory,
                        RANKS_DIR, name, exc)
            return None


class OverBudget(Exception):
    """A file left unread because this scrape has read its byte budget."""


class FileReader:
    """Reads metric files within one scrape's byte budget (`start_scrape` renews it), with the
    parsed keys cached across scrapes and each corrupt file logged once."""

    def __init__(self, max_file_bytes: int = MAX_FILE_BYTES,
                 max_scrape_bytes: int = MAX_SCRAPE_BYTES) -> None:
        self.max_file_bytes = max_file_bytes
        self.max_scrape_bytes = max_scrape_bytes
        self._budget = max_scrape_bytes
        self._key_cache: dict[str, Parsed] = {}
        self._corrupt_seen: set[tuple[str, int]] = set()

    def start_scrape(self) -> None:
        self._budget = self.max_scrape_bytes

    @property
    def corrupt_total(self) -> int:
        """Distinct corrupt files seen (a file counts again once replaced by another inode)."""
        return len(self._corrupt_seen)

    def parse_key(self, key: str) -> Parsed:
        """`parse_key`, cached; raises `CorruptFile`."""
        parsed = self._key_cache.get(key)
        if parsed is None:
            parsed = parse_key(key)
            if len(self._key_cache) > 200_000:
                self._key_cache.clear()
            self._key_cache[key] = parsed
        return parsed

    def parsed(self, db: DbFile) -> list[tuple[Parsed, Entry]]:
        """Every entry of the file with its parsed key; raises `OverBudget`, `CorruptFile` or
        `OSError` (`FileNotFoundError` when merged or removed since it was listed)."""
        return [(self.parse_key(e.key), e) for e in self._entries(db)]

    def read(self, db: DbFile, errors: list[str]) -> list[tuple[Parsed, Entry]]:
        """The file's parsed entries, or none at all when any part of it is corrupt."""
        try:
            return self.parsed(db)
        except FileNotFoundError:
            return []  # merged or removed between listing and reading
        except OverBudget as exc:
            errors.append(str(exc))
            return []
        except (CorruptFile, OSError) as exc:
            self.count_corrupt(db, str(exc), errors)
            return []

    def _entries(self, db: DbFile) -> list[Entry]:
        """`read_entries` within what is left of this scrape's byte budget."""
        if self._budget <= 0:
            raise OverBudget(f"{os.path.basename(db.path)}: not read, this scrape already read "
                             f"{self.max_scrape_bytes} bytes")
        entries = read_entries(db.path, self.max_file_bytes)
        self._budget -= sum(len(e.key) + 24 for e in entries) + 8
        return entries

    def count_corrupt(self, db: DbFile, reason: str, errors: list[str]) -> None:
        try:
            ident = (db.path, os.stat(db.path, follow_symlinks=False).st_ino)
        except OSError:
            ident = (db.path, 0)
        if ident not in self._corrupt_seen:
            self._corrupt_seen.add(ident)
            log.warning("skipping corrupt metrics file %s: %s", db.path, reason)
        errors.append(f"{os.path.basename(db.path)}: {reason}")
