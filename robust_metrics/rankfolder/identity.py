"""`ranks/<pid>.json`: who a rank process is, written by the hook, read by the sidecar and `stacks`.

One record per process: its run and rank, where it runs (node, local rank) and its place in the
parallel layout (world size, data/pipeline/tensor parallel coordinates). The hook also publishes
where it runs and its place in the layout as the labels of its own `robust_rank_info` series (the
sidecar passes that series through with the rest of the rank's metric files). This file tells who a
process is without reading its metrics: the sidecar maps pids to ranks for liveness and names stack
dumps with it, and `robust-metrics stacks --metrics-dir` reads it directly. All readers go through
`read_identity`, so the sidecar, `stacks` and the bridge report the same fields.

Values are strings, empty when unknown, as they are on the `robust_rank_info` labels.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from robust_metrics.numbers import decimal
from robust_metrics.rankfolder.safeio import open_dir, read_regular, write_atomic

__all__ = [
    "MAX_IDENTITY_BYTES",
    "RANKS_DIR",
    "TOPOLOGY_KEYS",
    "RankIdentity",
    "parse_identity",
    "pid_of",
    "rank_info",
    "read_identities",
    "read_identity",
    "write_identity",
]

RANKS_DIR = "ranks"
TOPOLOGY_KEYS = ("dp_rank", "pp_rank", "tp_rank")
MAX_IDENTITY_BYTES = 64 << 10
"""An identity is a few hundred bytes; a larger file is refused unread."""


@dataclass(frozen=True)
class RankIdentity:
    """Contents of `ranks/<pid>.json`; `uid` is the owner of the file (not part of its text)."""

    pid: int
    run: str
    rank: str
    local_rank: str = ""
    node: str = ""
    world_size: str = ""
    started: float | None = None
    finished: float | None = None  # written by the hook at a normal end: the exit is no crash
    crashed: float | None = None  # written by the hook when an uncaught exception ends the rank
    flush_interval: float | None = None  # seconds between the hook's writes of its files
    dp_rank: str = ""
    pp_rank: str = ""
    tp_rank: str = ""
    uid: int | None = None

    def labels(self) -> dict[str, str]:
        """Identity and topology as label strings: what a stack dump entry and rank_info carry."""
        return {"run": self.run, "rank": self.rank, "pid": str(self.pid),
                "local_rank": self.local_rank, "node": self.node, "world_size": self.world_size,
                "dp_rank": self.dp_rank, "pp_rank": self.pp_rank, "tp_rank": self.tp_rank}


def identity_name(pid: int) -> str:
    return f"{pid}.json"


def write_identity(directory: str, *, run: str, rank: int | str, local_rank: int | str,
                   node: str, world_size: int | str, topology: Mapping[str, int] | None = None,
                   pid: int | None = None, started: float | None = None,
                   finished: float | None = None, crashed: float | None = None,
                   flush_interval: float | None = None) -> str:
    """Write this process's identity into `directory/ranks/` atomically; returns the path."""
    pid = os.getpid() if pid is None else pid
    topology = dict(topology or {})
    record = {"run": run, "rank": rank, "local_rank": local_rank, "pid": pid, "node": node,
              "world_size": world_size, "topology": topology,
              "started": time.time() if started is None else started}
    if finished is not None:
        record["finished"] = finished
    if crashed is not None:
        record["crashed"] = crashed
    if flush_interval is not None:
        record["flush_interval"] = flush_interval
    os.makedirs(directory, exist_ok=True)
    fd = open_dir(os.path.join(directory, RANKS_DIR), create=True, mode=0o1733, listing=False)
    try:
        write_atomic(identity_name(pid), json.dumps(record).encode(), fd)
    finally:
        os.close(fd)
    return os.path.join(directory, RANKS_DIR, identity_name(pid))


def _text(value: Any) -> str:
    if value is None or isinstance(value, (dict, list)):
        return ""
    return str(value)


def _seconds(value: Any) -> float | None:
    """A JSON number as finite seconds, else None: a bool, text, an infinity, NaN, or an integer
    no float holds (float() of it raises OverflowError, which no reader of the file expects)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) else None


def _timestamp(record: Mapping[str, Any], key: str) -> float | None:
    value = record.get(key)
    if value is None:
        return None
    seconds = _seconds(value)
    if seconds is None:
        raise ValueError(f"{key}={str(value)[:40]!r} is not a time stamp")
    return seconds


MAX_FLUSH_INTERVAL = 3600.0


def _flush_interval(record: Mapping[str, Any]) -> float | None:
    """The hook's write interval, or None when absent or not a plausible number of seconds (the
    file is the job's: a value that is no duration is ignored, not trusted)."""
    value = record.get("flush_interval")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 < value <= MAX_FLUSH_INTERVAL else None


def _crashed(record: Mapping[str, Any], started: float | None) -> float | None:
    """When the rank says an exception ended it, or None when absent or not a time after its
    start (the file is the job's: a value that is no such time is ignored, not trusted)."""
    value = _seconds(record.get("crashed"))
    if value is None:
        return None
    return value if started is None or value >= started else None


def parse_identity(data: bytes, pid: int, uid: int | None = None) -> RankIdentity:
    """The identity in `data` (the file's bytes) of the process `pid`; ValueError when malformed.

    The pid comes from the file name, never from its text, so a file cannot claim another pid.
    """
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(record, dict) or "run" not in record or "rank" not in record:
        raise ValueError("not an identity: needs an object with run and rank")
    if isinstance(record["run"], (dict, list)) or isinstance(record["rank"], (dict, list)):
        raise ValueError("run and rank must be strings or numbers")
    started = _timestamp(record, "started")
    finished = _timestamp(record, "finished")
    topology = record.get("topology")
    topology = topology if isinstance(topology, dict) else {}
    return RankIdentity(
        pid=pid, run=str(record["run"]), rank=str(record["rank"]),
        local_rank=_text(record.get("local_rank")), node=_text(record.get("node")),
        world_size=_text(record.get("world_size")), started=started, finished=finished,
        dp_rank=_text(topology.get("dp_rank")), pp_rank=_text(topology.get("pp_rank")),
        tp_rank=_text(topology.get("tp_rank")), uid=uid,
        flush_interval=_flush_interval(record), crashed=_crashed(record, started))


def pid_of(name: str) -> int | None:
    """The pid named by an identity file name, or None for any other name."""
    stem = name[:-5] if name.endswith(".json") else ""
    return decimal(stem) if len(stem) <= 10 else None


def read_identity(name: str, ranks_fd: int) -> RankIdentity:
    """The identity file `name` in the open `ranks/` folder; OSError or ValueError when unusable."""
    pid = pid_of(name)
    if pid is None:
        raise ValueError(f"{name}: not an identity file name")
    uid = os.stat(name, dir_fd=ranks_fd, follow_symlinks=False).st_uid
    return parse_identity(read_regular(name, MAX_IDENTITY_BYTES, ranks_fd), pid, uid)


def read_identities(directory: str, run: str | None = None) -> dict[int, RankIdentity]:
    """Every readable identity in `directory/ranks/` (of `run` if given), keyed by pid.

    Raises FileNotFoundError when there is no `ranks/` folder, OSError when it is a link.
    Unreadable, linked or foreign files are skipped: a half-written file is normal at start-up.
    """
    fd = open_dir(os.path.join(directory, RANKS_DIR))
    out: dict[int, RankIdentity] = {}
    try:
        for name in sorted(os.listdir(fd)):
            if pid_of(name) is None:
                continue
            try:
                ident = read_identity(name, fd)
            except (OSError, ValueError):
                continue
            if run is None or ident.run == run:
                out[ident.pid] = ident
    finally:
        os.close(fd)
    return out


def rank_info(entries: Iterable[Mapping[str, Any] | RankIdentity]) -> list[dict[str, Any]]:
    """Topology records for `analysis.stacks.analyse` from identities or from stack dump entries.

    The sidecar's `/debug/stacks` entries carry every identity field, so `stacks` through
    sidecars, through `--metrics-dir` and through the bridge all build the same topology here.
    """
    out = []
    for entry in entries:
        fields = entry.labels() if isinstance(entry, RankIdentity) else entry
        if fields.get("rank") in (None, ""):
            continue
        record = {key: fields.get(key) for key in ("run", "rank", "pid", "node", "local_rank",
                                                   "world_size", *TOPOLOGY_KEYS)}
        out.append({k: v for k, v in record.items() if v not in (None, "")})
    return out
