"""`node_windows`: per-node summaries of the ranks' step windows, for the run-level rules.

Every run-level straggler rule (the run's median compute, its mean, the least time any rank
waits in collectives, the median step time) read every rank's window gauge once per evaluation:
at 16,384 ranks each such read is a pass over 16,384 series, and Prometheus' work grew as ranks x
windows. The sidecar already holds every rank of its node in each scrape, so it publishes, per
run, node and pipeline stage, the few statistics those rules combine (`SUMMARIES`): quantiles,
sums and counts over the node's ranks. The rules combine them over nodes (a minimum of minima,
a sum of sums, a median of medians) and keep every threshold (docs/architecture.md, "edge first").

A median of node medians is the run's median where a node holds one rank or all of the run's,
and close to it elsewhere: a slow rank moves its node's median by at most one rank's place.

Without a sidecar, the rule group `robust-node-summaries` (alert_rules/node_summaries.yml)
records the same series from the ranks' own; a test holds the two to the same values.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from robust_metrics import schema
from robust_metrics.sidecar.collectors.registry import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles, Snapshot

__all__ = ["SUMMARIES", "NodeSummary", "NodeWindowsCollector", "RankWindow", "quantile",
           "summarise"]

@dataclass(frozen=True)
class NodeSummary:
    """One summary the rules read: of which rank value, over which windows, which statistics
    (quantiles as their label value, `sum`, `count`)."""

    spec: schema.MetricSpec
    windows: tuple[str, ...]
    statistics: tuple[str, ...]


SUMMARIES: tuple[NodeSummary, ...] = (
    # the run's minute median and its two-rank reference (the faster rank), ranks per stage
    NodeSummary(schema.NODE_STEP_COMPUTE_MEAN, ("1m",), ("0", "0.5", "count")),
    # the run's mean compute (the ideal step's compute), over 2 and 5 minutes
    NodeSummary(schema.NODE_STEP_COMPUTE_MEAN, ("2m",), ("sum", "count")),
    # and over 5 minutes the median and the slowest rank (attribution)
    NodeSummary(schema.NODE_STEP_COMPUTE_MEAN, ("5m",), ("0.5", "1", "sum", "count")),
    NodeSummary(schema.NODE_STEP_DURATION_MEAN, ("2m", "5m"), ("0.5",)),
    NodeSummary(schema.NODE_STEP_BLOCKED_MEAN, ("2m", "5m"), ("0",)),
    NodeSummary(schema.NODE_STEP_COMPUTE_VARIATION, ("1m",), ("0.5",)),
    NodeSummary(schema.NODE_WINDOW_STEPS, ("1m",), ("0.5",)),
)
"""What the sidecar publishes per (run, node, pp_rank): only what a rule reads (series budget)."""

_COMPUTE = schema.STEP_COMPUTE_MEAN.name
_DURATION = schema.STEP_DURATION_MEAN.name
# the rank value each summary is over; blocked time is derived per rank from the other two
_SOURCE = {
    schema.NODE_STEP_COMPUTE_MEAN.name: _COMPUTE,
    schema.NODE_STEP_DURATION_MEAN.name: _DURATION,
    schema.NODE_STEP_COMPUTE_VARIATION.name: schema.STEP_COMPUTE_VARIATION.name,
    schema.NODE_WINDOW_STEPS.name: schema.WINDOW_STEPS.name,
}
_POSITIVE_ONLY = frozenset({_COMPUTE, _DURATION})  # a rank without timing publishes no mean


@dataclass(frozen=True)
class RankWindow:
    """One rank's window gauge as the sidecar serves it."""

    run: str
    rank: str
    metric: str
    window: str
    value: float


def quantile(ordered: list[float], q: float) -> float:
    """PromQL's `quantile`: linear interpolation between the closest ranks of sorted values."""
    position = q * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    weight = position - lower
    return ordered[lower] * (1 - weight) + ordered[upper] * weight


def _rank_values(windows: Iterable[RankWindow]) -> dict[tuple[str, str, str], dict[str, float]]:
    """`(metric, window, run) -> {rank: value}`, with each rank's blocked time derived."""
    values: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for w in windows:
        if math.isfinite(w.value):
            values[(w.metric, w.window, w.run)][w.rank] = w.value
    blocked = schema.NODE_STEP_BLOCKED_MEAN.name
    for (metric, window, run), durations in list(values.items()):
        if metric != _DURATION:
            continue
        computes = values.get((_COMPUTE, window, run), {})
        values[(blocked, window, run)] = {
            rank: max(duration - computes[rank], 0.0)
            for rank, duration in durations.items() if rank in computes}
    return values


def summarise(windows: Iterable[RankWindow], node: str,
              stage_of: dict[tuple[str, str], str]) -> list[Metric]:
    """The node's summaries (`SUMMARIES`) of its ranks' windows, grouped by run and by the
    rank's pipeline stage (`stage_of[(run, rank)]`, empty or absent without a pipeline)."""
    values = _rank_values(windows)
    families = {s.spec.name: Metric(s.spec.name, s.spec.help, "summary") for s in SUMMARIES}
    for summary in SUMMARIES:
        name = summary.spec.name
        source = _SOURCE.get(name, name)
        for window in summary.windows:
            for (metric, w, run), by_rank in sorted(values.items()):
                if metric != source or w != window:
                    continue
                stages: dict[str, list[float]] = defaultdict(list)
                for rank, value in by_rank.items():
                    if value > 0 or source not in _POSITIVE_ONLY:
                        stages[stage_of.get((run, rank), "")].append(value)
                for stage, stage_values in sorted(stages.items()):
                    labels = {"run": run, "node": node, "window": window}
                    if stage:
                        labels["pp_rank"] = stage
                    _add(families[name], labels, sorted(stage_values), summary.statistics)
    return [f for f in families.values() if f.samples]


def _add(family: Metric, labels: dict[str, str], ordered: list[float],
         statistics: tuple[str, ...]) -> None:
    for statistic in statistics:
        if statistic == "sum":
            family.add_sample(f"{family.name}_sum", labels, math.fsum(ordered))
        elif statistic == "count":
            family.add_sample(f"{family.name}_count", labels, float(len(ordered)))
        else:
            family.add_sample(family.name, {**labels, "quantile": statistic},
                              quantile(ordered, float(statistic)))


def rank_windows(snapshot: Snapshot) -> Iterator[RankWindow]:
    """The window gauges among the snapshot's merged families."""
    wanted = set(_SOURCE.values())
    for family in snapshot.families:
        if family.name not in wanted:
            continue
        for sample in family.samples:
            labels = sample.labels
            if "window" in labels and "rank" in labels:
                yield RankWindow(labels.get("run", ""), labels["rank"], family.name,
                                 labels["window"], sample.value)


def stages(snapshot: Snapshot) -> dict[tuple[str, str], str]:
    """`(run, rank) -> pp_rank` of the node's live rank processes."""
    return {(i.run, i.rank): i.pp_rank for pid, i in snapshot.identities.items()
            if snapshot.alive.get(pid)}


class NodeWindowsCollector:
    def __init__(self, folder: RankFiles, node: str) -> None:
        self.folder, self.node = folder, node

    def collect(self) -> Iterator[Metric]:
        snapshot = self.folder.snapshot()
        yield from summarise(rank_windows(snapshot), self.node, stages(snapshot))


@register_collector("node_windows", default_enabled=True,
                    help="per-node summaries of the ranks' step windows, which the run-level "
                         "straggler rules read instead of every rank's series")
def _factory(config: SidecarConfig, folder: RankFiles) -> NodeWindowsCollector:
    return NodeWindowsCollector(folder, config.node)
