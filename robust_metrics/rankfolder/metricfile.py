"""The multiprocess metric files of a rank folder: name, key, writer and defensive reader.

The format is prometheus_client's multiprocess format, so any `MultiProcessCollector` can read
what the hook writes. The writer does not use prometheus_client's `MmapedDict`: a store into a
shared mapping of a file on a full tmpfs raises SIGBUS, a signal no `try` can catch, and kills the
training process. `MetricFile` keeps the file's bytes in memory, reserves disk space with
`posix_fallocate` before it needs it and writes with `pwrite`, so a full or vanished folder is an
`OSError` that the hook counts, never a signal.

prometheus_client's own reader trusts the file: a truncated or scribbled file raises from deep
inside a scrape. The sidecar reads files written by processes that can die at any instant, so this
reader checks every length and offset and raises `CorruptFile` with the reason instead; the caller
skips the file and counts it (`robust_sidecar_corrupt_files_total`).

File layout (prometheus_client.mmap_dict): a 4-byte `used` size, 4 bytes of padding, then entries
of a 4-byte key length, the UTF-8 key padded to 8-byte alignment, and two doubles (value, timestamp).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from robust_metrics.numbers import decimal
from robust_metrics.rankfolder.safeio import open_regular

__all__ = [
    "MAX_FILE_BYTES",
    "CorruptFile",
    "DbFile",
    "Entry",
    "MetricFile",
    "file_name",
    "metric_key",
    "parse_key",
    "parse_name",
    "read_entries",
]

_INT = struct.Struct("i")
_TWO_DOUBLES = struct.Struct("dd")
_TYPES = ("counter", "gauge", "summary", "histogram")
_FIRST_READ = 8192  # covers the used part of a typical rank file (40 series)
_HEADER = 8
_CHUNK = 1 << 16  # space reserved at a time; a rank file of 40 series uses about 8 KiB
MAX_FILE_BYTES = 4 << 20
"""Most bytes of one file a reader takes: a hostile file cannot make it read gigabytes."""


class CorruptFile(Exception):
    """A `.db` file that cannot be read; the message says why."""


@dataclass(frozen=True)
class DbFile:
    """A multiprocess file, identified from its name: `<type>[_<gauge mode>]_<pid>.db`."""

    path: str
    type: str
    mode: str
    pid: int


class Entry(NamedTuple):
    """One sample of a file: the raw key (JSON text), its value and timestamp."""

    key: str
    value: float
    timestamp: float


def parse_name(directory: str, name: str) -> DbFile | None:
    """The file's type, gauge mode and pid, or None for a name that is not a multiprocess file."""
    if not name.endswith(".db"):
        return None
    parts = name[:-3].split("_")
    typ, pid = parts[0], decimal(parts[-1])
    if typ not in _TYPES or pid is None:
        return None
    if typ == "gauge":
        if len(parts) != 3:
            return None
        mode = parts[1]
    elif len(parts) == 2:
        mode = ""
    else:
        return None
    return DbFile(os.path.join(directory, name), typ, mode, pid)


def file_name(prefix: str, pid: int) -> str:
    """`<prefix>_<pid>.db`, where prefix is `counter`, `summary`, `histogram` or `gauge_<mode>`."""
    return f"{prefix}_{pid}.db"


def metric_key(metric: str, sample: str, label_names: Sequence[str],
               label_values: Sequence[str], help_text: str) -> str:
    """The JSON key of one sample, byte for byte as prometheus_client writes it."""
    labels = dict(zip(label_names, label_values, strict=True))
    return json.dumps([metric, sample, labels, help_text], sort_keys=True)


def _encode_entry(key: str) -> bytes:
    encoded = key.encode("utf-8")
    padding = b" " * (8 - (len(encoded) + 4) % 8)
    return _INT.pack(len(encoded)) + encoded + padding + _TWO_DOUBLES.pack(0.0, 0.0)


class MetricFile:
    """One multiprocess file, written by one process with `pwrite`, never through a mapping.

    `write()` only changes memory; `sync()` writes the changed file in one `pwrite` of the entries
    and then one of the header, so a reader never sees a used size that covers unwritten bytes.
    The file is opened with `O_NOFOLLOW` and must be a regular file owned by this user: a link
    planted under the rank's name cannot make the rank overwrite another of its owner's files.
    Raises OSError (ENOSPC when the folder is full) from the constructor and `sync()`; never a
    signal.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o644)
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionError(f"{path}: not a regular file of this user")
            os.fchmod(self._fd, 0o644)  # readable by a sidecar without DAC_OVERRIDE, any umask
            os.ftruncate(self._fd, 0)  # a pid reused from a dead process starts afresh
            self._capacity = 0
            try:
                self._reserve(_CHUNK)
            except OSError:  # a full disk: leave no empty file for the sidecar to flag as corrupt
                os.unlink(path)
                raise
        except BaseException:
            os.close(self._fd)
            raise
        self._data = bytearray(_INT.pack(_HEADER) + b"\0" * 4)
        self._positions: dict[str, int] = {}
        self._synced_used = 0

    def _reserve(self, size: int) -> None:
        """Allocate the disk blocks up to `size` now, so a later write cannot find the disk full."""
        if size <= self._capacity:
            return
        capacity = max(self._capacity, _CHUNK)
        while capacity < size:
            capacity *= 2
        try:
            os.posix_fallocate(self._fd, 0, capacity)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate on this fs
                raise
            os.ftruncate(self._fd, capacity)
        self._capacity = capacity

    def slot(self, key: str) -> int:
        """The position of the sample `key` (see `metric_key`), added on first use; pass it to
        `set`, which a flush calls for every sample, so the key is looked up once."""
        pos = self._positions.get(key)
        if pos is None:
            self._data += _encode_entry(key)
            pos = self._positions[key] = len(self._data) - 16
        return pos

    def set(self, pos: int, value: float, timestamp: float) -> None:
        """Set the sample at `pos` in memory; `sync()` publishes it."""
        _TWO_DOUBLES.pack_into(self._data, pos, value, timestamp)

    def write(self, key: str, value: float, timestamp: float) -> None:
        """Set the sample `key` in memory; `sync()` publishes it."""
        self.set(self.slot(key), value, timestamp)

    def sync(self) -> None:
        """Write the file's bytes; OSError when the disk is full or the file cannot be written."""
        used = len(self._data)
        self._reserve(used)
        _INT.pack_into(self._data, 0, used)
        os.pwrite(self._fd, memoryview(self._data)[_HEADER:], _HEADER)
        if used != self._synced_used:
            os.pwrite(self._fd, memoryview(self._data)[:_HEADER], 0)
            self._synced_used = used

    def vanished(self) -> bool:
        """True when the file was deleted under this process (its folder removed, for example)."""
        return os.fstat(self._fd).st_nlink == 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_entries(path: str, max_bytes: int = MAX_FILE_BYTES) -> list[Entry]:
    """Every entry of the file; raises CorruptFile (or OSError when it vanished, is a link, is
    not a regular file).

    Usually one read() of the used part: this runs for every rank file on every scrape, so it
    avoids Python file objects, and never reads the unused preallocated space. A header that
    claims more than `max_bytes` is refused before anything more is read.
    """
    fd = open_regular(path)
    try:
        data = os.read(fd, _FIRST_READ)
        if len(data) < 8:
            raise CorruptFile(f"{len(data)} bytes, shorter than the 8-byte header")
        used = _INT.unpack_from(data, 0)[0]
        if used == 0:  # created, nothing written yet
            return []
        if used < 8:
            raise CorruptFile(f"header says {used} bytes used")
        if used > max_bytes:
            raise CorruptFile(f"header says {used} bytes used, more than the {max_bytes} "
                              "a rank file may have")
        while len(data) < used:
            more = os.read(fd, used - len(data))
            if not more:
                raise CorruptFile(f"header says {used} bytes used of a {len(data)}-byte file")
            data += more
    finally:
        os.close(fd)
    entries = []
    pos = 8
    while pos < used:
        if pos + 4 > used:
            raise CorruptFile(f"entry header at {pos} runs past the used size {used}")
        length = _INT.unpack_from(data, pos)[0]
        padded = length + (8 - (length + 4) % 8)
        end = pos + 4 + padded + 16
        if length <= 0 or end > used:
            raise CorruptFile(f"entry at {pos} has a bad key length {length}")
        try:
            key = data[pos + 4: pos + 4 + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptFile(f"entry at {pos}: key is not UTF-8 ({exc})") from None
        value, timestamp = _TWO_DOUBLES.unpack_from(data, end - 16)
        entries.append(Entry(key, value, timestamp))
        pos = end
    return entries


def parse_key(key: str) -> tuple[str, str, tuple[tuple[str, str], ...], str]:
    """(metric name, sample name, sorted labels, help) of a key; raises CorruptFile when malformed."""
    try:
        metric, sample, labels, help_text = json.loads(key)
    except (ValueError, TypeError) as exc:
        raise CorruptFile(f"key {key[:80]!r} is not a metric key: {exc}") from None
    if not (isinstance(metric, str) and isinstance(sample, str) and isinstance(help_text, str)
            and isinstance(labels, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
        raise CorruptFile(f"key {key[:80]!r} has fields of the wrong type")
    if not sample.startswith(metric):
        raise CorruptFile(f"sample {sample!r} does not belong to metric {metric!r}")
    return metric, sample, tuple(sorted(labels.items())), help_text
