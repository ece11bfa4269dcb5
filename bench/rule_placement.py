"""Where Prometheus places the rule groups for a rule-file path, and how crowded that is.

Prometheus 2.42 starts each group at `xxhash64(label set {file=<path>, name=<group>}) mod
interval` into every evaluation interval (each label name and value followed by a 0xff byte).
This script scores candidate paths by a model of four rounds, with each group's cost alone from a
`bench/rules_scale.py` result (its quiet replay): every group starts at its offset, and groups
running at once share `--cores` equally (processor sharing). It prints the share of paths whose
every group is predicted under 1 s, and the best, median and worst paths, for
`bench/rules_scale.py --rule-file PATH` to measure (bench/README.md, runs 20-27):

    .venv/bin/python bench/rule_placement.py RESULT.json [--paths 2000] [--cores 1]
        [--pattern /tmp/robust-metrics-placement/{k}/rules.yml]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's robust_metrics, installed or not
sys.path.insert(0, str(ROOT / "bench"))

from rules_scale import BASELINE  # noqa: E402

from robust_metrics import rules  # noqa: E402

_MASK = (1 << 64) - 1
_P1, _P2, _P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P4, _P5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _round(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * _P2) & _MASK, 31) * _P1) & _MASK


def xxh64(data: bytes) -> int:
    """XXH64 with seed 0 (the hash of Prometheus' label sets), in pure Python."""
    n, i = len(data), 0
    if n >= 32:
        v = [(_P1 + _P2) & _MASK, _P2, 0, (-_P1) & _MASK]
        while i + 32 <= n:
            v = [_round(acc, lane)
                 for acc, lane in zip(v, struct.unpack_from("<4Q", data, i), strict=True)]
            i += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _MASK
        for acc in v:
            h = ((h ^ _round(0, acc)) * _P1 + _P4) & _MASK
    else:
        h = _P5
    h = (h + n) & _MASK
    while i + 8 <= n:
        h = (_rotl(h ^ _round(0, struct.unpack_from("<Q", data, i)[0]), 27) * _P1 + _P4) & _MASK
        i += 8
    if i + 4 <= n:
        lane = struct.unpack_from("<I", data, i)[0] * _P1 & _MASK
        h = (_rotl(h ^ lane, 23) * _P2 + _P3) & _MASK
        i += 4
    for byte in data[i:]:
        h = (_rotl(h ^ (byte * _P5 & _MASK), 11) * _P1) & _MASK
    h = ((h ^ (h >> 33)) * _P2) & _MASK
    h = ((h ^ (h >> 29)) * _P3) & _MASK
    return h ^ (h >> 32)


def start_offset(group: str, rule_file: str, interval: float) -> float:
    """Seconds into each interval at which Prometheus 2.42 evaluates `group` of `rule_file`."""
    key = b"file\xff" + rule_file.encode() + b"\xffname\xff" + group.encode() + b"\xff"
    return xxh64(key) % round(interval * 1e9) / 1e9


def predicted_durations(starts: Sequence[tuple[str, float, float, float]], cores: float,
                        horizon: float) -> dict[str, float]:
    """Median evaluation time per group of those starting in the first `horizon` seconds, for
    groups `(name, offset, interval, cost alone)` sharing `cores` equally while they run."""
    arrivals = sorted((offset + k * interval, name, cost)
                      for name, offset, interval, cost in starts if cost > 0
                      for k in range(int(horizon // interval) + 1)
                      if offset + k * interval < horizon)
    running: list[list[Any]] = []  # [work left, start, name]
    took: dict[str, list[float]] = {}
    now, i = 0.0, 0
    while i < len(arrivals) or running:
        if not running:
            now, name, cost = arrivals[i]
            running.append([cost, now, name])
            i += 1
            continue
        rate = min(1.0, cores / len(running))
        finish = now + min(job[0] for job in running) / rate
        arrive = arrivals[i][0] if i < len(arrivals) else float("inf")
        step = min(finish, arrive) - now
        for job in running:
            job[0] -= step * rate
        now += step
        for job in [job for job in running if job[0] <= 1e-12]:
            running.remove(job)
            took.setdefault(job[2], []).append(now - job[1])
        if arrive <= finish:
            _, name, cost = arrivals[i]
            running.append([cost, now, name])
            i += 1
    return {name: sorted(times)[len(times) // 2] for name, times in took.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path,
                        help="a bench/rules_scale.py output with a quiet replay (the costs)")
    parser.add_argument("--paths", type=int, default=2000, help="candidate paths (default 2000)")
    parser.add_argument("--cores", type=float, default=1.0,
                        help="cores the groups share in the model (default 1: the scrapes and "
                             "the garbage collector take about the other of 2)")
    parser.add_argument("--interval", default="15s", help="the global evaluation interval")
    parser.add_argument("--pattern", default="/tmp/robust-metrics-placement/{k}/rules.yml",
                        help="candidate path, {k} the candidate's number")
    args = parser.parse_args(argv)
    text = args.result.read_text()
    costs = json.loads(text[text.index("{"):])["prometheus"]["quiet_replay_s"]
    interval = rules.parse_duration(args.interval) / 1000
    groups = [(g["name"], rules.parse_duration(g["interval"]) / 1000 if "interval" in g
               else interval) for g in [*rules.load_groups(), BASELINE]]
    scored = []
    for k in range(args.paths):
        path = args.pattern.format(k=k)
        took = predicted_durations([(name, start_offset(name, path, every), every,
                                     costs.get(name, 0.0)) for name, every in groups],
                                   args.cores, 4 * interval)
        scored.append((max(took.values()), sum(t > 1.0 for t in took.values()), path))
    scored.sort()
    report = {"paths": len(scored),
              "share_with_every_group_under_1s": sum(s[0] <= 1.0 for s in scored) / len(scored)}
    for label, (slowest, over, path) in (("best", scored[0]), ("median", scored[len(scored) // 2]),
                                         ("worst", scored[-1])):
        report[label] = {"path": path, "slowest_group_s": round(slowest, 3),
                         "groups_over_1s": over}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
