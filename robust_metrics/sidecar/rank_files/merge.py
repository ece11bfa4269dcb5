"""Merging the processes' samples into families, as prometheus_client's
`MultiProcessCollector.merge` does, file by file.

Counters, summaries and histograms add up across processes (a histogram's buckets are made
cumulative once, over the sums); gauges follow the mode in their file's name: `all` keeps one
series per pid, `sum`, `max` and `min` combine, `mostrecent` (the rank hook's mode) keeps the value
with the newest timestamp. A dead process's gauges are not merged: they vanish at once. Values the
archive took from deleted files are added like one more file.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from robust_metrics import schema
from robust_metrics.rankfolder.metricfile import CorruptFile, DbFile
from robust_metrics.sidecar.rank_files.scan import FileReader, Parsed
from robust_metrics.sidecar.rank_files.snapshot import Labels

__all__ = ["Accumulator", "last_steps", "merge_live"]

_LAST_STEP = schema.LAST_STEP_TIMESTAMP.name


class Accumulator:
    """Samples of many processes' files merged into one value per series."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}  # metric -> (type, help)
        self.values: dict[str, dict[tuple[str, Labels], float]] = defaultdict(dict)
        self.stamps: dict[tuple[str, str, Labels], float] = {}

    def add(self, typ: str, mode: str, pid: int, metric: str, sample: str, labels: Labels,
            help_text: str, value: float, timestamp: float) -> None:
        self.meta.setdefault(metric, (typ, help_text))
        values = self.values[metric]
        key = (sample, labels)
        mode = mode.removeprefix("live")
        if typ != "gauge" or mode == "sum":
            values[key] = values.get(key, 0.0) + value
        elif mode == "all":
            values[(sample, (*labels, ("pid", str(pid))))] = value
        elif mode in ("max", "min"):
            current = values.get(key)
            if current is None or (value > current if mode == "max" else value < current):
                values[key] = value
        else:  # mostrecent, the rank hook's mode
            stamp_key = (metric, sample, labels)
            if key not in values or timestamp > self.stamps[stamp_key]:
                values[key] = value
                self.stamps[stamp_key] = timestamp

    def add_archived(self, archived: dict[tuple[str, str], float],
                     parse_key: Callable[[str], Parsed]) -> None:
        """The archive's `(type, key) -> value`, as from one more file; keys that do not parse
        are left out."""
        for (typ, key), value in archived.items():
            try:
                metric, sample, labels, help_text = parse_key(key)
            except CorruptFile:
                continue
            self.add(typ, "", 0, metric, sample, labels, help_text, value, 0.0)

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


def merge_live(acc: Accumulator, files: dict[int, list[DbFile]], alive: dict[int, bool],
               archived: set[int], reader: FileReader, errors: list[str]) -> set[str]:
    """Add every file still in the folder to `acc`, but the pids just archived and the gauges of
    dead pids; return the runs that live processes' accumulating series carry."""
    live_runs: set[str] = set()
    for pid, dbs in files.items():
        if pid in archived:
            continue
        for db in dbs:
            if not alive[pid] and db.type == "gauge":
                continue  # a dead process's gauges vanish at once
            for (metric, sample, labels, help_text), entry in reader.read(db, errors):
                acc.add(db.type, db.mode, pid, metric, sample, labels, help_text,
                        entry.value, entry.timestamp)
                if alive[pid] and db.type != "gauge":
                    live_runs.update(v for k, v in labels if k == "run")
    return live_runs


def last_steps(families: list[Metric]) -> dict[tuple[str, str], float]:
    """`(run, rank) -> ` the time of its last completed step, from the merged families."""
    last_step = {}
    for family in families:
        if family.name == _LAST_STEP:
            for s in family.samples:
                last_step[(s.labels.get("run", ""), s.labels.get("rank", ""))] = s.value
    return last_step
