"""Read prometheus_client multiprocess `.db` files defensively.

prometheus_client's own reader trusts the file: a truncated or scribbled file raises from deep
inside a scrape. The sidecar reads files written by processes that can die at any instant, so this
reader checks every length and offset and raises `CorruptFile` with the reason instead; the caller
skips the file and counts it (`robust_sidecar_corrupt_files_total`).

File layout (prometheus_client.mmap_dict): a 4-byte `used` size, 4 bytes of padding, then entries
of a 4-byte key length, the UTF-8 key padded to 8-byte alignment, and two doubles (value, timestamp).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CorruptFile", "DbFile", "Entry", "parse_key", "parse_name", "read_entries"]

_INT = struct.Struct("i")
_TWO_DOUBLES = struct.Struct("dd")
_TYPES = ("counter", "gauge", "summary", "histogram")
_FIRST_READ = 8192  # covers the used part of a typical rank file (40 series)


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
    typ = parts[0]
    if typ not in _TYPES or not parts[-1].isdigit():
        return None
    if typ == "gauge":
        if len(parts) != 3:
            return None
        mode = parts[1]
    elif len(parts) == 2:
        mode = ""
    else:
        return None
    return DbFile(os.path.join(directory, name), typ, mode, int(parts[-1]))


def read_entries(path: str) -> list[Entry]:
    """Every entry of the file; raises CorruptFile (or OSError when it vanished).

    Usually one read() of the used part: this runs for every rank file on every scrape, so it
    avoids Python file objects and stat calls, and never reads the unused preallocated space.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, _FIRST_READ)
        if len(data) < 8:
            raise CorruptFile(f"{len(data)} bytes, shorter than the 8-byte header")
        used = _INT.unpack_from(data, 0)[0]
        if used == 0:  # created, nothing written yet
            return []
        if used < 8:
            raise CorruptFile(f"header says {used} bytes used")
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
