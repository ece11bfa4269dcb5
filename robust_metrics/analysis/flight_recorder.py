"""Which ranks never reached the last collective of each process group, from PyTorch Flight
Recorder dumps.

Flight Recorder keeps the last N collectives of every process group in each rank
(`TORCH_FR_BUFFER_SIZE=N`, or `TORCH_NCCL_TRACE_BUFFER_SIZE`). Its dumps come as pickles written
by the NCCL watchdog on a timeout (`TORCH_NCCL_DEBUG_INFO_TEMP_FILE`/`TORCH_FR_DUMP_TEMP_FILE`
prefix plus the rank) or as JSON from `torch._C._distributed_c10d._dump_fr_trace_json()` on
demand (gloo records too). Stacks say where a rank is; Flight Recorder says which collective the
others wait for and who never entered it: in a group whose ranks enqueued up to sequence number
S, a rank whose last collective is below S is missing.

Pickles are read with an unpickler that refuses every class, so a dump can only yield plain
dicts, lists, strings and numbers.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

__all__ = ["analyse_dumps", "analyse_paths", "load_dump"]

_RANK_SUFFIX = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")


class _PlainUnpickler(pickle.Unpickler):
    """Plain data only: a dump is not trusted code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a Flight Recorder "
                                     "dump (plain data only)")


MAX_DUMP_BYTES = 256 << 20
"""A Flight Recorder dump of 20,000 entries is a few MB; a larger file is refused unread."""


def load_dump(path: str) -> tuple[int, dict[str, Any]]:
    """(rank, dump) of one file; the rank is the dump's `rank` field or the file name's suffix.

    Raises ValueError naming the file for anything that is not a well-formed dump.
    """
    with open(path, "rb") as f:
        raw = f.read(MAX_DUMP_BYTES + 1)
    if len(raw) > MAX_DUMP_BYTES:
        raise ValueError(f"{path}: larger than {MAX_DUMP_BYTES} bytes; not a Flight Recorder dump")
    try:
        dump = json.loads(raw)
    except ValueError:
        try:
            dump = _PlainUnpickler(io.BytesIO(raw)).load()
        except Exception as exc:
            raise ValueError(f"{path}: neither Flight Recorder JSON nor a pickle ({exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise ValueError(f"{path}: not a Flight Recorder dump (no `entries` list)")
    rank = dump.get("rank")
    if rank is None:
        m = _RANK_SUFFIX.search(os.path.basename(path))
        if not m:
            raise ValueError(f"{path}: no rank in the dump and none at the end of the file name")
        rank = m.group(1)
    _clean(dump, path)  # a malformed dump is refused here, with the file named
    return _rank(rank, path), dump


def _rank(value: Any, where: str) -> int:
    """A rank or sequence number: a non-negative integer below 2**63, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{where}: {value!r} is not a rank or sequence number")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not a rank or sequence number") from None
    if not 0 <= number < 1 << 63:
        raise ValueError(f"{where}: {value!r} is out of range")
    return number


def _clean_entry(entry: Any, where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an entry is {type(entry).__name__}, not an object")
    pg = entry.get("process_group") or [str(entry.get("pg_id", "?")), ""]
    if not isinstance(pg, (list, tuple)) or not pg:
        raise ValueError(f"{where}: process_group {pg!r} is not a [name, description] pair")
    seq = entry.get("collective_seq_id") or 0
    return {"is_p2p": bool(entry.get("is_p2p")),
            "process_group": [str(pg[0]), str(pg[1]) if len(pg) > 1 else ""],
            "collective_seq_id": _rank(seq, f"{where}: collective_seq_id"),
            "profiling_name": str(entry.get("profiling_name", "?"))}


def _clean(dump: dict[str, Any], where: str) -> dict[str, Any]:
    """The parts of a dump the analysis reads, type-checked: plain data of known shape."""
    entries = [_clean_entry(e, where) for e in dump.get("entries") or []]
    status: dict[str, int] = {}
    raw_status = dump.get("pg_status") or {}
    if not isinstance(raw_status, dict):
        raise ValueError(f"{where}: pg_status is not an object")
    for group, value in raw_status.items():
        enqueued = value.get("last_enqueued_collective") if isinstance(value, dict) else None
        if enqueued is not None and not (isinstance(enqueued, int) and enqueued < 0):
            status[str(group)] = _rank(enqueued, f"{where}: last_enqueued_collective")
    config: dict[str, list[int] | None] = {}
    raw_config = dump.get("pg_config") or {}
    if not isinstance(raw_config, dict):
        raise ValueError(f"{where}: pg_config is not an object")
    for group, value in raw_config.items():
        config[str(group)] = _config_ranks(value, where)
    return {"entries": entries, "pg_status": status, "pg_config": config}


def _config_ranks(entry: Any, where: str) -> list[int] | None:
    ranks = entry.get("ranks") if isinstance(entry, dict) else None
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            return None
    if not isinstance(ranks, list):
        return None
    return [_rank(r, f"{where}: pg_config ranks") for r in ranks]


def _group_ranks(dump: dict[str, Any], name: str) -> list[int] | None:
    config = dump["pg_config"]
    if name not in config and len(config) == 1:
        return next(iter(config.values()))  # gloo keys its only group by ''
    return config.get(name)


def analyse_dumps(dumps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per process group: the last collective any rank enqueued, and the ranks that did not.

    `dumps`: rank -> Flight Recorder dump. Returns `{groups: [{group, description, ranks,
    last_seq, last_collective, missing_ranks, no_dump, seq_by_rank}], missing_ranks, errors}`.
    """
    last: dict[str, dict[int, int]] = defaultdict(dict)
    names: dict[tuple[str, int], str] = {}
    members: dict[str, set[int]] = defaultdict(set)
    descriptions: dict[str, str] = {}
    for key, raw in dumps.items():
        rank = _rank(key, "Flight Recorder dump key")
        if not isinstance(raw, dict):
            raise ValueError(f"Flight Recorder dump of rank {rank} is not an object")
        dump = _clean(raw, f"rank {rank}")
        for entry in dump["entries"]:
            if entry["is_p2p"]:
                continue
            group, description = entry["process_group"]
            descriptions.setdefault(group, description)
            seq = entry["collective_seq_id"]
            if seq > last[group].get(rank, -1):
                last[group][rank] = seq
            names[(group, seq)] = entry["profiling_name"]
        for group, enqueued in dump["pg_status"].items():
            last[group][rank] = max(last[group].get(rank, -1), enqueued)
        for group in list(last):
            if rank in last[group]:
                ranks = _group_ranks(dump, group)
                members[group].update(ranks if ranks is not None else [rank])
    groups = []
    for group in sorted(last, key=lambda g: (len(g), g)):
        seqs = last[group]
        top = max(seqs.values())
        ranks = sorted(members[group] | set(seqs))
        missing = sorted(r for r in ranks if r in dumps and seqs.get(r, -1) < top)
        no_dump = sorted(r for r in ranks if r not in dumps)
        groups.append({
            "group": group, "description": descriptions.get(group, ""), "ranks": ranks,
            "last_seq": top, "last_collective": names.get((group, top), "?"),
            "missing_ranks": missing, "no_dump": no_dump,
            "seq_by_rank": {str(r): seqs[r] for r in sorted(seqs)},
        })
    every = sorted({r for g in groups for r in g["missing_ranks"]})
    return {"groups": groups, "missing_ranks": every, "errors": []}


def _files(paths: Iterable[str]) -> list[str]:
    out: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            out.extend(os.path.join(path, n) for n in sorted(os.listdir(path))
                       if os.path.isfile(os.path.join(path, n)))
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise ValueError(f"{path}: no such file or folder")
    return out


def analyse_paths(paths: Iterable[str]) -> dict[str, Any]:
    """`analyse_dumps` over files and folders; unreadable files are listed in `errors`."""
    dumps: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    for path in _files(paths):
        try:
            rank, dump = load_dump(path)
        except (OSError, ValueError) as exc:
            errors.append(str(exc))
            continue
        dumps[rank] = dump
    if not dumps:
        raise ValueError("no Flight Recorder dump could be read: " + "; ".join(errors))
    report = analyse_dumps(dumps)
    report["errors"] = errors
    return report
