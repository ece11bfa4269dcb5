"""`node_summaries`: per-node summaries of the ranks' series, for the run-level rules.

Every run-level rule (the run's median compute, its mean, the least time any rank waits in
collectives, the newest global step, whether some rank is in a checkpoint) read every rank's
series once per evaluation: at 16,384 ranks each such read is a pass over 16,384 series, and
Prometheus' work grew as ranks x rules. The sidecar already holds every rank of its node in each
scrape, so it publishes, per run and node (and pipeline stage, for the step windows), the few
statistics those rules combine (`SUMMARIES`): quantiles, sums and counts over the node's ranks.
The rules combine them over nodes (a minimum of minima, a sum of sums, a median of medians) and
keep every threshold (docs/architecture.md, "edge first").

A median of node medians is the run's median where a node holds one rank or all of the run's,
and close to it elsewhere: a slow rank moves its node's median by at most one rank's place.

Without a sidecar, the rule group `robust-node-summaries` (alert_rules/node_summaries.yml)
records the same series from the ranks' own; a test holds the two to the same values. The
summary of step ages, which only the process collector computes, is published there
(`process.py`), with the same function.
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

__all__ = ["BLOCKED", "PROCESS_SUMMARIES", "SUMMARIES", "SUMMARISED_ONLY",
           "NodeSummariesCollector", "NodeSummary", "RankValue", "quantile", "rank_values",
           "summarise"]

BLOCKED = "blocked"
"""The source of the blocked-time summary: each rank's window mean step time minus its mean
compute (at least 0), derived from the two."""


@dataclass(frozen=True)
class NodeSummary:
    """One summary the rules read: of which rank series (`source`), which statistics (quantiles
    as their label value, `sum`, `count`), for which of its `key` label's values (`window`,
    `phase`; empty: all, or a series without one). A stage summary splits the node's ranks by
    pipeline stage; `positive` leaves out ranks whose value is not above 0 (a rank without
    timing publishes no mean)."""

    spec: schema.MetricSpec
    source: str
    statistics: tuple[str, ...]
    key: str = ""
    values: tuple[str, ...] = ()
    by_stage: bool = False
    positive: bool = False


_COMPUTE = schema.STEP_COMPUTE_MEAN.name
_DURATION = schema.STEP_DURATION_MEAN.name

SUMMARIES: tuple[NodeSummary, ...] = (
    # the step windows, per stage. The run's minute median and its two-rank reference (the
    # faster rank), ranks per stage:
    NodeSummary(schema.NODE_STEP_COMPUTE_MEAN, _COMPUTE, ("0", "0.5", "count"), "window",
                ("1m",), by_stage=True, positive=True),
    # the run's mean compute (the ideal step's compute), over 2 and 5 minutes
    NodeSummary(schema.NODE_STEP_COMPUTE_MEAN, _COMPUTE, ("sum", "count"), "window", ("2m",),
                by_stage=True, positive=True),
    # and over 5 minutes the median and the slowest rank (attribution)
    NodeSummary(schema.NODE_STEP_COMPUTE_MEAN, _COMPUTE, ("0.5", "1", "sum", "count"), "window",
                ("5m",), by_stage=True, positive=True),
    NodeSummary(schema.NODE_STEP_DURATION_MEAN, _DURATION, ("0.5",), "window", ("2m", "5m"),
                by_stage=True, positive=True),
    NodeSummary(schema.NODE_STEP_BLOCKED_MEAN, BLOCKED, ("0",), "window", ("2m", "5m"),
                by_stage=True),
    NodeSummary(schema.NODE_STEP_COMPUTE_VARIATION, schema.STEP_COMPUTE_VARIATION.name,
                ("0.5",), "window", ("1m",), by_stage=True),
    NodeSummary(schema.NODE_WINDOW_STEPS, schema.WINDOW_STEPS.name, ("0.5",), "window", ("1m",),
                by_stage=True),
    # progress, per run
    NodeSummary(schema.NODE_GLOBAL_STEP, schema.GLOBAL_STEP.name, ("1",)),
    NodeSummary(schema.NODE_STEPS, schema.STEPS_TOTAL.name, ("sum", "count")),
    NodeSummary(schema.NODE_COLLECTIVES_ENTERED, schema.COLLECTIVES_ENTERED.name, ("sum",)),
    # some rank out of training; some rank in a checkpoint, in evaluation
    NodeSummary(schema.NODE_PHASE, schema.PHASE.name, ("0",), "phase", ("train",)),
    NodeSummary(schema.NODE_PHASE, schema.PHASE.name, ("1",), "phase", ("checkpoint", "eval")),
    NodeSummary(schema.NODE_LAST_STEP_TIMESTAMP, schema.LAST_STEP_TIMESTAMP.name, ("1",),
                positive=True),
    NodeSummary(schema.NODE_LAST_CHECKPOINT_TIMESTAMP, schema.LAST_CHECKPOINT_TIMESTAMP.name,
                ("1",), positive=True),
    NodeSummary(schema.NODE_LOSS, schema.LOSS.name, ("sum", "count")),
    NodeSummary(schema.NODE_GRAD_NORM, schema.GRAD_NORM.name, ("1",)),
    NodeSummary(schema.NODE_NONFINITE_GRAD, schema.NONFINITE_GRAD.name, ("1",)),
    NodeSummary(schema.NODE_SKIPPED_STEPS, schema.SKIPPED_STEPS.name, ("sum",)),
)
"""What the sidecar publishes per node: only what a rule reads (series budget)."""

PROCESS_SUMMARIES: tuple[NodeSummary, ...] = (
    # the ages of ranks that have neither exited nor finished: the process collector publishes
    # an age for no other rank
    NodeSummary(schema.NODE_RANK_STEP_AGE, schema.RANK_STEP_AGE.name, ("0",)),
    NodeSummary(schema.NODE_RANK_PROCESS_ALIVE, schema.RANK_PROCESS_ALIVE.name, ("1", "count")),
)
"""What the process collector publishes per node, of the series only it computes."""

SUMMARISED_ONLY: frozenset[tuple[str, str]] = frozenset({
    (schema.STEP_COMPUTE_MEAN.name, "2m"),
    (schema.STEP_DURATION_MEAN.name, "2m"),
    (schema.STEP_DURATION_MEAN.name, "5m"),
    (schema.WINDOW_STEPS.name, "1m"),
})
"""Rank window gauges (metric, window) that no rule, dashboard or check reads rank by rank: the
sidecar summarises them and does not serve them (series budget; the ranks' in-process exporters
serve them for the rule group that summarises them where no sidecar runs)."""


@dataclass(frozen=True)
class RankValue:
    """One sample of a rank's series as the sidecar serves it; `key` is the value of its
    summary's key label (`window`, `phase`), empty for a series without one."""

    run: str
    rank: str
    metric: str
    key: str
    value: float


def quantile(ordered: list[float], q: float) -> float:
    """PromQL's `quantile`: linear interpolation between the closest ranks of sorted values."""
    position = q * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    weight = position - lower
    return ordered[lower] * (1 - weight) + ordered[upper] * weight


def _by_rank(samples: Iterable[RankValue]) -> dict[tuple[str, str, str], dict[str, float]]:
    """`(metric, key, run) -> {rank: value}`: a rank's samples of one key add up (a counter per
    process group), non-finite values are left out, and each rank's blocked time is derived."""
    values: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for v in samples:
        if math.isfinite(v.value):
            ranks = values[(v.metric, v.key, v.run)]
            ranks[v.rank] = ranks.get(v.rank, 0.0) + v.value
    for (metric, window, run), durations in list(values.items()):
        if metric == _DURATION:
            computes = values.get((_COMPUTE, window, run), {})
            values[(BLOCKED, window, run)] = {
                rank: max(duration - computes[rank], 0.0)
                for rank, duration in durations.items() if rank in computes}
    return values


def summarise(samples: Iterable[RankValue], node: str, stage_of: dict[tuple[str, str], str],
              summaries: Iterable[NodeSummary] = SUMMARIES) -> list[Metric]:
    """The node's `summaries` of its ranks' samples, per run (and per the rank's pipeline stage,
    `stage_of[(run, rank)]`, for a stage summary; empty or absent without a pipeline)."""
    values = sorted(_by_rank(samples).items())
    families: dict[str, Metric] = {}
    for summary in summaries:
        name = summary.spec.name
        family = families.setdefault(name, Metric(name, summary.spec.help, "summary"))
        for (metric, key, run), by_rank in values:
            if metric != summary.source or (summary.values and key not in summary.values):
                continue
            groups: dict[str, list[float]] = defaultdict(list)
            for rank, value in by_rank.items():
                if value > 0 or not summary.positive:
                    stage = stage_of.get((run, rank), "") if summary.by_stage else ""
                    groups[stage].append(value)
            for stage, group in sorted(groups.items()):
                labels = {"run": run, "node": node}
                if summary.key and key:
                    labels[summary.key] = key
                if stage:
                    labels["pp_rank"] = stage
                _add(family, labels, sorted(group), summary.statistics)
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


def rank_values(snapshot: Snapshot, summaries: Iterable[NodeSummary] = SUMMARIES
                ) -> Iterator[RankValue]:
    """The samples of the snapshot's merged families that `summaries` summarise."""
    keys = {s.source: s.key for s in summaries}
    keys.setdefault(_COMPUTE, "window")
    keys.setdefault(_DURATION, "window")
    for family in snapshot.families:
        for sample in family.samples:
            key = keys.get(sample.name)
            labels = sample.labels
            if key is not None and "rank" in labels:
                yield RankValue(labels.get("run", ""), labels["rank"], sample.name,
                                labels.get(key, ""), sample.value)


def stages(snapshot: Snapshot) -> dict[tuple[str, str], str]:
    """`(run, rank) -> pp_rank` of the node's live rank processes."""
    return {(i.run, i.rank): i.pp_rank for pid, i in snapshot.identities.items()
            if snapshot.alive.get(pid)}


class NodeSummariesCollector:
    def __init__(self, folder: RankFiles, node: str) -> None:
        self.folder, self.node = folder, node

    def collect(self) -> Iterator[Metric]:
        snapshot = self.folder.snapshot()
        yield from summarise(rank_values(snapshot), self.node, stages(snapshot))


@register_collector("node_summaries", default_enabled=True,
                    help="per-node summaries of the ranks' step windows and progress, which the "
                         "run-level rules read instead of every rank's series")
def _factory(config: SidecarConfig, folder: RankFiles) -> NodeSummariesCollector:
    return NodeSummariesCollector(folder, config.node)
