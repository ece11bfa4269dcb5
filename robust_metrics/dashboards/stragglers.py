"""The "Stragglers" dashboard: which ranks slow the run down, and why (compute, collectives, data, GC)."""

from __future__ import annotations

from robust_metrics.dashboards.model import DashboardSpec, PanelSpec, Section, Target
from robust_metrics.dashboards.queries import (
    ALERTS,
    COMPUTE_RATIO,
    EXPLAINED,
    RANKS,
    RI,
    SLOWDOWN,
    STAGE_SLOWDOWN,
    STEP_AGE,
    VERDICT,
    by_dp_and_stage,
    mean,
    on_nodes,
    with_topology,
)
from robust_metrics.dashboards.styles import (
    chain,
    heatmap,
    hide_time,
    matrix,
    names,
    stacked,
    table_sorted,
    thresholds,
)

STRAGGLERS = DashboardSpec(
    uid="robust-stragglers",
    file="stragglers.json",
    title="Stragglers",
    description="Which ranks slow the run down, and why: compute, collectives, data, GC.",
    annotations=(ALERTS,),
    sections=(
        Section("Compute time relative to the run median", (
            PanelSpec("Compute time / run median (rank x time)", "heatmap",
                      (Target(COMPUTE_RATIO, "{{rank}}"),),
                      "Each rank's compute time (step time minus time blocked in collectives) "
                      "over the run's median. An isolated hot cell is one bad worker; a "
                      "horizontal stripe is one slow rank; a block of adjacent ranks is a "
                      "pipeline stage or a node.", width=24, height=12, style=heatmap),
            PanelSpec("Slowest ranks", "table",
                      (Target(with_topology(f"topk(10, {COMPUTE_RATIO})"), "", True),),
                      "The ten ranks with the highest compute time relative to the median, with "
                      "their node and parallel coordinates (from robust_rank_info).",
                      width=12, height=9, style=chain(hide_time, table_sorted("Value"))),
            PanelSpec("Online slowdown estimate", "timeseries",
                      (Target(SLOWDOWN, "{{run}}"),),
                      "Estimated slowdown S = actual step time / step time without stragglers "
                      "(1.0 = no loss). The offline what-if analysis refines it from op traces.",
                      width=12, height=9,
                      style=thresholds((None, "green"), (1.1, "orange"), (1.3, "red"))),
        )),
        Section("Attribution: DP ranks and pipeline stages", (
            PanelSpec("Compute ratio by DP rank and PP stage", "table",
                      (Target(by_dp_and_stage(COMPUTE_RATIO), "", True),),
                      "The slowest rank's compute time over the run median for each data-parallel "
                      "rank (rows) and pipeline stage (columns), from robust_rank_info's "
                      "topology. One hot cell is one bad worker; a hot column is a heavy stage.",
                      width=10, height=9, style=chain(hide_time, matrix("dp_rank", "pp_rank"))),
            PanelSpec("Slowdown S by pipeline stage", "timeseries", (
                Target(SLOWDOWN, "S {{run}}"),
                Target(STAGE_SLOWDOWN, "stage {{pp_rank}} {{run}}"),
            ), "S of the run, and each stage's S: the ideal step time with only that stage's "
               "ranks at their real compute time (alert_rules/attribution.yml). The stage whose "
               "line tracks the run's S is the one to fix.", width=8, height=9),
            PanelSpec("Straggler verdict", "stat", (Target(VERDICT, "{{verdict}}", True),),
                      "The straggler study's classification: worker (the top 3% of ranks explain "
                      "half the slowdown or more), stage (the last pipeline stage does), spread "
                      "(neither), none (S below 1.03).", width=6, height=4, style=names),
            PanelSpec("Share of the slowdown explained", "timeseries",
                      (Target(EXPLAINED, "{{share}} {{run}}"),),
                      "M_W: the share of the slowdown removed by making the slowest 3% of ranks "
                      "ideal; M_S: by making the last pipeline stage ideal. Recorded while S >= "
                      "1.03.", unit="percentunit", width=6, height=5),
        )),
        Section("Where the time goes", (
            PanelSpec("Collective time by op", "timeseries",
                      (Target(f"sum by (run, op) (rate(robust_collective_duration_seconds_sum"
                              f"{{{RANKS}}}[{RI}])) / ignoring(op) group_left "
                              f"sum by (run) (rate(robust_step_duration_seconds_sum{{{RANKS}}}[{RI}]))",
                              "{{op}} {{run}}"),),
                      "Share of step time the selected ranks spend in collectives, by op kind. In "
                      "a synchronous job the slow rank shows the least: its peers wait for it.",
                      unit="percentunit", width=8, style=stacked),
            PanelSpec("Data wait per rank", "timeseries",
                      (Target(mean("robust_data_wait_seconds", RANKS), "rank {{rank}}"),),
                      "Mean time per step from the end of an optimizer step to the next forward "
                      "pass: data loading and host work.", unit="s", width=8),
            PanelSpec("GC pauses per rank", "timeseries",
                      (Target(f"rate(robust_gc_pause_seconds_sum{{{RANKS}}}[{RI}])", "rank {{rank}}"),),
                      "Share of wall time each rank spends in Python garbage collector pauses. "
                      "Uncoordinated GC is a classic source of stragglers.",
                      unit="percentunit", width=8),
            PanelSpec("Compute time per rank", "timeseries",
                      (Target(on_nodes(mean("robust_step_compute_seconds", RANKS)),
                              "rank {{rank}} ({{node}})"),),
                      "Mean compute time per step of each rank on the selected nodes.",
                      unit="s", width=8),
            PanelSpec("Seconds since last step", "timeseries",
                      (Target(STEP_AGE, "rank {{rank}}"),),
                      "Age of each rank's last completed step (from the sidecar, else the rank). "
                      "One rank far behind its peers while they sit in a collective is the "
                      "culprit of a hang.", unit="s", width=8),
            PanelSpec("Collectives in flight", "timeseries",
                      (Target(f"robust_collectives_entered_total{{{RANKS}}} - "
                              f"robust_collectives_completed_total{{{RANKS}}}",
                              "rank {{rank}} {{group}}"),),
                      "Collectives launched but not completed, per rank and process group. In a "
                      "hang, the rank that lags behind its group in launched collectives is the "
                      "one that never arrived.", unit="none", width=8),
        )),
    ),
)
