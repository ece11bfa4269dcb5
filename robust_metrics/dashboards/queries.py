"""PromQL shared by the dashboards: Grafana variable selectors, helpers, recording-rule names.

Queries name only metrics from `robust_metrics.schema` and recording rules from `alert_rules/`
(`level:metric:operations`); tests fail on any other name. `expand` turns a query into what Grafana
sends to Prometheus, so the tests can run it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

RUN = 'run=~"$run"'
RANKS = 'run=~"$run", rank=~"$rank"'
NODES = 'node=~"$node"'
RI = "$__rate_interval"


def mean(metric: str, sel: str, window: str = RI) -> str:
    """Mean of a summary over the window: rate of its sum over rate of its count."""
    return f"rate({metric}_sum{{{sel}}}[{window}]) / rate({metric}_count{{{sel}}}[{window}])"


def increase(selector: str, window: str = RI) -> str:
    """Increase of a counter over the window, counting a series born inside it in full.

    Counters that exist only once something happened (XID codes, bridge actions, hook errors)
    appear at 1; plain `increase()` reads that first event as no increase at all.
    """
    return f"({selector} unless {selector} offset {window} or increase({selector}[{window}]))"


def on_nodes(expr: str) -> str:
    """Keep the per-rank series of ranks on the selected nodes, adding their `node` label.

    Topology lives on one info series per rank (principle 4); the recording rule keeps one per
    (run, rank), so a restarted rank's second pid cannot make the join many-to-many.
    """
    return f"({expr}) * on(run, rank) group_left(node) {RANK_NODE}{{{RUN}, {NODES}}}"


def with_topology(expr: str) -> str:
    """Add node, local rank and data/pipeline/tensor-parallel coordinates from robust_rank_info."""
    return (f"({expr}) * on(run, rank) group_left(node, local_rank, dp_rank, pp_rank, tp_rank) "
            f"topk by (run, rank) (1, robust_rank_info{{{RUN}, {NODES}}})")


# Recording rules of alert_rules/ (`level:metric:operations`); tests check every name used here
# against alert_rules/*.yml. They smooth over 5 minutes, as the alerts do.
COMPUTE_RATIO = (f"max without (window) (robust_step_compute_mean_seconds{{{RANKS}, window=\"5m\"}}"
                 f" / on (run) group_left () run:robust_step_compute_seconds:median5m{{{RUN}}})")
STEP_TIME_MEDIAN = f"run:robust_step_duration_seconds:median5m{{{RUN}}}"
STEP_TIME_MAX = (f"max by (run) (robust_node_step_duration_mean_seconds{{{RUN}, window=\"5m\", "
                 f"quantile=\"0.5\"}})")
THROUGHPUT = f"run:robust_steps:rate5m{{{RUN}}}"
SLOWDOWN = f"run:robust_straggler_slowdown:ratio5m{{{RUN}}}"
ETTR_1H = f"run:robust_ettr:ratio1h{{{RUN}}}"
ETTR_START = f"run:robust_ettr:ratio_since_start{{{RUN}}}"
STEP_AGE = f"robust_rank_step_age_seconds{{{RANKS}}}"
RANK_NODE = "run_rank:robust_rank_info:last"
STAGE_SLOWDOWN = f"run_stage:robust_straggler_slowdown:ratio5m{{{RUN}}}"
VERDICT = f"run:robust_straggler_verdict:class5m{{{RUN}}}"
EXPLAINED = (f'label_replace(run:robust_straggler_explained_by_workers:ratio5m{{{RUN}}}, '
             f'"share", "M_W (top 3% of ranks)", "", "") or '
             f'label_replace(run:robust_straggler_explained_by_last_stage:ratio5m{{{RUN}}}, '
             f'"share", "M_S (last stage)", "", "")')
MFU = f"run:robust_mfu:ratio5m{{{RUN}}}"
RANK_FLOPS = f"rate(robust_model_flops_total{{{RANKS}}}[{RI}])"


def by_dp_and_stage(expr: str) -> str:
    """A per-rank value as one series per (run, DP rank, pipeline stage): the stage's slowest."""
    return (f"max by (run, dp_rank, pp_rank) (({expr}) * on(run, rank) "
            f"group_left(dp_rank, pp_rank) topk by (run, rank) (1, robust_rank_info{{{RUN}}}))")


# Firing alerts of the selected runs, an annotation on every dashboard.
ALERTS = ("Alerts", "red", f'ALERTS{{alertstate="firing", {RUN}}}')


# --- queries as Prometheus sees them ------------------------------------------------------------
GRAFANA_BUILTINS = ("__rate_interval", "__interval", "__range")
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def expand(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with Grafana's variables replaced, as Grafana sends it to Prometheus.

    `values` maps a variable name (run, node, rank, __rate_interval, __range, ...) to its
    already formatted value; for a multi-value variable in a regex matcher that is `(a|b)` or the
    All value `.*`. An unknown variable is an error, so a typo cannot reach Prometheus as `$rnu`.
    """
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"query uses ${name}, which has no value; known: {', '.join(values)}")
        return values[name]

    return _VARIABLE.sub(replace, expr)
