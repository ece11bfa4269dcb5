"""`process`: what only an outside observer can say about a rank process.

A rank stuck in a collective cannot report that it is stuck; the sidecar can. Per rank (the newest
process of each `run`/`rank` pair in `ranks/<pid>.json`): whether the process is alive, its CPU
time and resident memory, and the seconds since its last completed step, computed at scrape time
from `robust_last_step_timestamp_seconds` (or from the process start before its first step), so the
age of a hung rank keeps growing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.sidecar.collector import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rankdir import RankFolder, RankIdentity

__all__ = ["ProcessCollector", "newest_per_rank"]

LABELS = ["run", "rank"]


def newest_per_rank(identities: dict[int, RankIdentity]) -> dict[tuple[str, str], RankIdentity]:
    """The latest process of each (run, rank): a restarted rank replaces its dead predecessor."""
    newest: dict[tuple[str, str], RankIdentity] = {}
    for ident in identities.values():
        key = (ident.run, ident.rank)
        known = newest.get(key)
        if known is None or (ident.started or 0.0, ident.pid) > (known.started or 0.0, known.pid):
            newest[key] = ident
    return newest


class ProcessCollector:
    def __init__(self, folder: RankFolder) -> None:
        self.folder = folder

    def collect(self) -> Iterator[Metric]:
        s = schema
        snapshot = self.folder.snapshot()
        alive_f = GaugeMetricFamily(s.RANK_PROCESS_ALIVE.name, s.RANK_PROCESS_ALIVE.help,
                                    labels=LABELS)
        cpu_f = CounterMetricFamily(s.RANK_PROCESS_CPU.name, s.RANK_PROCESS_CPU.help,
                                    labels=LABELS)
        rss_f = GaugeMetricFamily(s.RANK_PROCESS_RSS.name, s.RANK_PROCESS_RSS.help, labels=LABELS)
        age_f = GaugeMetricFamily(s.RANK_STEP_AGE.name, s.RANK_STEP_AGE.help, labels=LABELS)
        now = time.time()
        for (run, rank), ident in sorted(newest_per_rank(snapshot.identities).items()):
            labels = [run, rank]
            alive = snapshot.alive.get(ident.pid, False)
            if alive:  # the snapshot may be a quarter second old: ask again
                try:
                    proc = psutil.Process(ident.pid)
                    with proc.oneshot():
                        times = proc.cpu_times()
                        rss = proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    alive = False
                except psutil.AccessDenied:
                    times, rss = None, None
            alive_f.add_metric(labels, 1.0 if alive else 0.0)
            if not alive:
                continue
            if times is not None:
                cpu_f.add_metric(labels, times.user + times.system)
                rss_f.add_metric(labels, float(rss))
            last = snapshot.last_step.get((run, rank))
            since = last if last else ident.started
            if since:
                age_f.add_metric(labels, max(0.0, now - since))
        yield from (alive_f, cpu_f, rss_f, age_f)


@register_collector("process", default_enabled=True,
                    help="rank process liveness, CPU, memory and step age")
def _factory(config: SidecarConfig, folder: RankFolder) -> ProcessCollector:
    return ProcessCollector(folder)
