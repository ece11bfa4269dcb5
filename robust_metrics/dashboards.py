"""The Grafana dashboards, built with grafana-foundation-sdk and written as committed JSON.

    robust-metrics dashboards --out dashboards/           # write dashboards/*.json
    robust-metrics dashboards --out dashboards/ --check   # exit 1 when the committed JSON is stale

Dashboards are declared as data first (`DashboardSpec` of `PanelSpec`s, each with its PromQL and
what the panel needs to show data, `Needs`), then rendered through the SDK's builders. Keeping the
declaration as data lets the tests run every query against a real Prometheus and know which panels
show only faults, without parsing Grafana JSON back into intent.

Queries name only metrics from `robust_metrics.schema` and recording rules from `alert_rules/`
(`level:metric:operations`); tests fail on any other name. The JSON targets Grafana 11.6 (the SDK's
version); it imports into Grafana 10.4 and later.
"""

from __future__ import annotations

import argparse
import enum
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DASHBOARDS",
    "DashboardSpec",
    "Needs",
    "PanelSpec",
    "Target",
    "build",
    "configure",
    "expand",
    "iter_targets",
    "render_all",
    "run",
    "variable_queries",
]

GRAFANA_VERSION = "11.6"
TAG = "robust-metrics"
DATASOURCE_VAR = "datasource"


class Needs(enum.StrEnum):
    """What must be true for a panel to show data; the e2e test proves each kind it can produce."""

    TRAINING = "training"  # a job running with the hook, scraped for a minute, rules loaded
    CHECKPOINT = "checkpoint"  # a rank has completed a checkpoint
    NONFINITE = "nonfinite"  # fault: a NaN/Inf loss or gradient (zero otherwise)
    ALERT = "alert"  # fault: an alert is firing
    HOOK_ERROR = "hook_error"  # fault: the hook caught an exception
    SIDECAR = "sidecar"  # the node sidecar is scraped
    GPU = "gpu"  # the sidecar reads NVML
    GPU_FAULT = "gpu_fault"  # fault: XID events, GPU fallen off the bus
    NIC = "nic"  # the sidecar reads InfiniBand/RoCE ports or network devices
    BRIDGE = "bridge"  # the action bridge is scraped and has acted
    HANG = "hang"  # fault: the bridge named a hang suspect


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel. `instant` for stats and tables, a range query otherwise."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class PanelSpec:
    """One panel: kind (timeseries, stat, table, heatmap, bargauge), queries, size, needs.

    `style` adjusts the SDK builder (units are set from `unit`); it never changes the queries.
    """

    title: str
    kind: str
    targets: tuple[Target, ...]
    description: str
    unit: str = ""
    width: int = 12
    height: int = 8
    needs: Needs = Needs.TRAINING
    style: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Section:
    """A row of the dashboard: a title and panels laid out left to right, wrapping at 24 columns."""

    title: str
    panels: tuple[PanelSpec, ...]


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    file: str
    title: str
    description: str
    sections: tuple[Section, ...]
    annotations: tuple[tuple[str, str, str], ...] = ()  # (name, colour, expr)
    variables: tuple[str, ...] = ("run", "node", "rank")
    panels_flat: tuple[PanelSpec, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "panels_flat", tuple(p for s in self.sections for p in s.panels))


# --- PromQL helpers -----------------------------------------------------------------------------
RUN = 'run=~"$run"'
RANKS = 'run=~"$run", rank=~"$rank"'
NODES = 'node=~"$node"'
RI = "$__rate_interval"


def _mean(metric: str, sel: str, window: str = RI) -> str:
    """Mean of a summary over the window: rate of its sum over rate of its count."""
    return f"rate({metric}_sum{{{sel}}}[{window}]) / rate({metric}_count{{{sel}}}[{window}])"


def _increase(selector: str, window: str = RI) -> str:
    """Increase of a counter over the window, counting a series born inside it in full.

    Counters that exist only once something happened (XID codes, bridge actions, hook errors)
    appear at 1; plain `increase()` reads that first event as no increase at all.
    """
    return f"({selector} unless {selector} offset {window} or increase({selector}[{window}]))"


def _on_nodes(expr: str) -> str:
    """Keep the per-rank series of ranks on the selected nodes, adding their `node` label.

    Topology lives on one info series per rank (principle 4); the recording rule keeps one per
    (run, rank), so a restarted rank's second pid cannot make the join many-to-many.
    """
    return f"({expr}) * on(run, rank) group_left(node) {RANK_NODE}{{{RUN}, {NODES}}}"


def _with_topology(expr: str) -> str:
    """Add node, local rank and data/pipeline/tensor-parallel coordinates from robust_rank_info."""
    return (f"({expr}) * on(run, rank) group_left(node, local_rank, dp_rank, pp_rank, tp_rank) "
            f"topk by (run, rank) (1, robust_rank_info{{{RUN}, {NODES}}})")


# Recording rules of alert_rules/ (`level:metric:operations`); tests check every name used here
# against alert_rules/*.yml. They smooth over 5 minutes, as the alerts do.
COMPUTE_RATIO = f"run_rank:robust_step_compute_seconds:ratio_to_median5m{{{RANKS}}}"
STEP_TIME_MEDIAN = f"run:robust_step_duration_seconds:median5m{{{RUN}}}"
STEP_TIME_MAX = f"max by (run) (run_rank:robust_step_duration_seconds:mean5m{{{RUN}}})"
THROUGHPUT = f"run:robust_steps:rate5m{{{RUN}}}"
SLOWDOWN = f"run:robust_straggler_slowdown:ratio5m{{{RUN}}}"
ETTR_1H = f"run:robust_ettr:ratio1h{{{RUN}}}"
ETTR_START = f"run:robust_ettr:ratio_since_start{{{RUN}}}"
STEP_AGE = f"run_rank:robust_step_age_seconds:max{{{RANKS}}}"
RANK_NODE = "run_rank:robust_rank_info:last"


# --- panel styles -------------------------------------------------------------------------------
def _points(builder: Any) -> Any:
    """Lines with every sample drawn, so a single-step spike is visible at any zoom."""
    from grafana_foundation_sdk.models.common import VisibilityMode

    return builder.show_points(VisibilityMode.ALWAYS).point_size(4)


def _log(builder: Any) -> Any:
    from grafana_foundation_sdk.builders.common import ScaleDistributionConfig
    from grafana_foundation_sdk.models.common import ScaleDistribution, VisibilityMode

    return (builder.scale_distribution(ScaleDistributionConfig().type(ScaleDistribution.LOG).log(10))
            .show_points(VisibilityMode.ALWAYS).point_size(4))


def _bars(builder: Any) -> Any:
    from grafana_foundation_sdk.models.common import GraphDrawStyle

    return builder.draw_style(GraphDrawStyle.BARS).fill_opacity(80)


def _stacked(builder: Any) -> Any:
    from grafana_foundation_sdk.builders.common import StackingConfig
    from grafana_foundation_sdk.models.common import StackingMode

    return builder.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(40)


def _thresholds(*steps: tuple[float | None, str]) -> Callable[[Any], Any]:
    def apply(builder: Any) -> Any:
        from grafana_foundation_sdk.builders.dashboard import ThresholdsConfig
        from grafana_foundation_sdk.models.dashboard import Threshold, ThresholdsMode

        return builder.thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
            [Threshold(value=v, color=c) for v, c in steps]))
    return apply


_ETTR_COLOURS = _thresholds((None, "red"), (0.8, "orange"), (0.9, "green"))
_ZERO_GOOD = _thresholds((None, "green"), (1, "red"))


def _heatmap(builder: Any) -> Any:
    """Ranks as rows, time as columns; 1.0 (the median) is neutral, hot cells are slow ranks."""
    from grafana_foundation_sdk.builders.heatmap import (
        HeatmapColorOptions,
        RowsHeatmapOptions,
        YAxisConfig,
    )
    from grafana_foundation_sdk.models.common import HeatmapCellLayout
    from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale

    return (builder.calculate(False)
            .color(HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("RdYlBu")
                   .reverse(True).scale(HeatmapColorScale.LINEAR).steps(64).min(0.5).max(1.5))
            .rows_frame(RowsHeatmapOptions().layout(HeatmapCellLayout.UNKNOWN).value("compute/median"))
            .y_axis(YAxisConfig().axis_label("rank").reverse(True))
            .cell_gap(1))


def _table_sorted(column: str) -> Callable[[Any], Any]:
    def apply(builder: Any) -> Any:
        from grafana_foundation_sdk.builders.common import TableSortByFieldState

        return builder.sort_by([TableSortByFieldState().display_name(column).desc(True)])
    return apply


def _hide_time(builder: Any) -> Any:
    """Instant tables: drop the Time column, keep labels and the value."""
    from grafana_foundation_sdk.models.dashboard import DataTransformerConfig

    return builder.with_transformation(DataTransformerConfig(
        id_val="organize", options={"excludeByName": {"Time": True, "__name__": True}}))


def _chain(*styles: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def apply(builder: Any) -> Any:
        for s in styles:
            builder = s(builder)
        return builder
    return apply


# --- the four dashboards ------------------------------------------------------------------------
_ALERTS = ("Alerts", "red", f'ALERTS{{alertstate="firing", {RUN}}}')

TRAINING_OVERVIEW = DashboardSpec(
    uid="robust-training-overview",
    file="training-overview.json",
    title="Training overview",
    description="Is the run making progress, how fast, and is it numerically healthy.",
    annotations=(_ALERTS,),
    sections=(
        Section("Goodput", (
            PanelSpec("ETTR (1 h)", "stat", (Target(ETTR_1H, "{{run}}", True),),
                      "Effective training time ratio over the last hour: time spent in productive "
                      "training steps over wall time. Below 0.9 the run loses more than 6 min an "
                      "hour to hangs, restarts, checkpoints or slow steps.",
                      unit="percentunit", width=4, height=5, style=_ETTR_COLOURS),
            PanelSpec("ETTR (since start)", "stat",
                      (Target(ETTR_START, "{{run}}", True),),
                      "Effective training time ratio since the run started (restarts included).",
                      unit="percentunit", width=4, height=5, style=_ETTR_COLOURS),
            PanelSpec("Throughput", "stat", (Target(THROUGHPUT, "{{run}}", True),),
                      "Optimizer steps per second of the run (over the last minute).",
                      unit="none", width=4, height=5),
            PanelSpec("Global step", "stat",
                      (Target(f"max by (run) (robust_global_step{{{RUN}}})", "{{run}}", True),),
                      "Training step counter, including steps restored from a checkpoint.",
                      unit="none", width=4, height=5),
            PanelSpec("Time since last checkpoint", "stat",
                      (Target(f"time() - max by (run) "
                              f"(robust_last_checkpoint_timestamp_seconds{{{RUN}}} > 0)",
                              "{{run}}", True),),
                      "Seconds since the newest successful checkpoint of any rank: the work a "
                      "crash would throw away now. Empty until the first checkpoint.",
                      unit="s", width=4, height=5, needs=Needs.CHECKPOINT,
                      style=_thresholds((None, "green"), (3600, "orange"), (7200, "red"))),
            PanelSpec("Restarts", "stat",
                      (Target(f"sum by (run) (resets(robust_steps_total{{{RUN}}}[$__range]))",
                              "{{run}}", True),),
                      "Rank process restarts in the dashboard's time range (resets of the "
                      "per-process step counter, summed over ranks).",
                      unit="none", width=4, height=5, style=_ZERO_GOOD),
        )),
        Section("Speed", (
            PanelSpec("Step time (median and max across ranks)", "timeseries", (
                Target(STEP_TIME_MEDIAN, "median {{run}}"),
                Target(STEP_TIME_MAX, "max {{run}}"),
            ), "Mean step time per rank over the rate window, as the median and the maximum "
               "across the run's ranks. A gap between the two is a straggler; both rising "
               "together is the whole job slowing down.", unit="s"),
            PanelSpec("Throughput over time", "timeseries",
                      (Target(THROUGHPUT, "{{run}}"),),
                      "Optimizer steps per second of the run.", unit="none"),
        )),
        Section("Numerics", (
            PanelSpec("Loss", "timeseries", (
                Target(f"robust_loss{{{RANKS}}}", "rank {{rank}}"),
                Target(f"avg_over_time(run:robust_loss:mean{{{RUN}}}[5m])", "5 min mean {{run}}"),
            ), "Loss of each rank's last step, with every sample drawn so a one-step spike "
               "shows, against the run's 5 minute mean (of finite values: one NaN does not "
               "blank the baseline).",
               width=8, style=_points),
            PanelSpec("Gradient norm", "timeseries",
                      (Target(f"robust_grad_norm{{{RANKS}}}", "rank {{rank}}"),),
                      "Total L2 norm of the gradients (log scale): spikes precede loss spikes "
                      "and divergence.", width=8, style=_log),
            PanelSpec("Non-finite steps", "timeseries", (
                Target(f"sum by (run) {_increase(f'robust_nonfinite_loss_steps_total{{{RANKS}}}')}",
                       "loss {{run}}"),
                Target(f"sum by (run) {_increase(f'robust_nonfinite_grad_steps_total{{{RANKS}}}')}",
                       "gradient {{run}}"),
            ), "Steps whose loss or gradient norm was NaN or infinite. Zero in a healthy run.",
               width=8, needs=Needs.NONFINITE, style=_bars),
        )),
        Section("Alerts and phases", (
            PanelSpec("Active alerts", "table",
                      (Target(f'ALERTS{{alertstate="firing", {RUN}}}', "", True),),
                      "Alerts firing now for the selected runs (Prometheus ALERTS series).",
                      width=12, needs=Needs.ALERT, style=_hide_time),
            PanelSpec("Ranks per phase", "timeseries",
                      (Target(f"sum by (run, phase) (robust_phase{{{RUN}}})", "{{phase}} {{run}}"),),
                      "How many ranks are training, evaluating or checkpointing. Hang and slowness "
                      "alerts stay silent outside `train`.", width=6, style=_stacked),
            PanelSpec("Hook errors", "timeseries",
                      (Target(f"sum by (run, where) {_increase(f'robust_hook_errors_total{{{RUN}}}')}",
                              "{{where}} {{run}}"),),
                      "Exceptions the hook caught (training went on). Any value here means a "
                      "metric may be missing or wrong.", width=6, needs=Needs.HOOK_ERROR, style=_bars),
        )),
    ),
)

STRAGGLERS = DashboardSpec(
    uid="robust-stragglers",
    file="stragglers.json",
    title="Stragglers",
    description="Which ranks slow the run down, and why: compute, collectives, data, GC.",
    annotations=(_ALERTS,),
    sections=(
        Section("Compute time relative to the run median", (
            PanelSpec("Compute time / run median (rank x time)", "heatmap",
                      (Target(COMPUTE_RATIO, "{{rank}}"),),
                      "Each rank's compute time (step time minus time blocked in collectives) "
                      "over the run's median. An isolated hot cell is one bad worker; a "
                      "horizontal stripe is one slow rank; a block of adjacent ranks is a "
                      "pipeline stage or a node.", width=24, height=12, style=_heatmap),
            PanelSpec("Slowest ranks", "table",
                      (Target(_with_topology(f"topk(10, {COMPUTE_RATIO})"), "", True),),
                      "The ten ranks with the highest compute time relative to the median, with "
                      "their node and parallel coordinates (from robust_rank_info).",
                      width=12, height=9, style=_chain(_hide_time, _table_sorted("Value"))),
            PanelSpec("Online slowdown estimate", "timeseries",
                      (Target(SLOWDOWN, "{{run}}"),),
                      "Estimated slowdown S = actual step time / step time without stragglers "
                      "(1.0 = no loss). The offline what-if analysis refines it from op traces.",
                      width=12, height=9,
                      style=_thresholds((None, "green"), (1.1, "orange"), (1.3, "red"))),
        )),
        Section("Where the time goes", (
            PanelSpec("Collective time by op", "timeseries",
                      (Target(f"sum by (run, op) (rate(robust_collective_duration_seconds_sum"
                              f"{{{RANKS}}}[{RI}])) / ignoring(op) group_left "
                              f"sum by (run) (rate(robust_step_duration_seconds_sum{{{RANKS}}}[{RI}]))",
                              "{{op}} {{run}}"),),
                      "Share of step time the selected ranks spend in collectives, by op kind. In "
                      "a synchronous job the slow rank shows the least: its peers wait for it.",
                      unit="percentunit", width=8, style=_stacked),
            PanelSpec("Data wait per rank", "timeseries",
                      (Target(_mean("robust_data_wait_seconds", RANKS), "rank {{rank}}"),),
                      "Mean time per step from the end of an optimizer step to the next forward "
                      "pass: data loading and host work.", unit="s", width=8),
            PanelSpec("GC pauses per rank", "timeseries",
                      (Target(f"rate(robust_gc_pause_seconds_sum{{{RANKS}}}[{RI}])", "rank {{rank}}"),),
                      "Share of wall time each rank spends in Python garbage collector pauses. "
                      "Uncoordinated GC is a classic source of stragglers.",
                      unit="percentunit", width=8),
            PanelSpec("Compute time per rank", "timeseries",
                      (Target(_on_nodes(_mean("robust_step_compute_seconds", RANKS)),
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

NODE_GPU_HEALTH = DashboardSpec(
    uid="robust-node-gpu-health",
    file="node-gpu-health.json",
    title="Node and GPU health",
    description="GPUs, NICs and the sidecar of the nodes a run uses, from the node sidecar.",
    annotations=(_ALERTS,),
    sections=(
        Section("GPU", (
            PanelSpec("GPU utilisation", "timeseries",
                      (Target(f"robust_gpu_utilization_ratio{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "Fraction of time a kernel ran. A GPU idling while its peers are busy is "
                      "waiting for a straggler or for data.", unit="percentunit", width=8,
                      needs=Needs.GPU),
            PanelSpec("GPU memory used", "timeseries",
                      (Target(f"robust_gpu_memory_used_bytes{{{NODES}}} / "
                              f"robust_gpu_memory_total_bytes{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "GPU memory in use over total.", unit="percentunit", width=8, needs=Needs.GPU),
            PanelSpec("GPU temperature", "timeseries",
                      (Target(f"robust_gpu_temperature_celsius{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "Core temperature; thermal throttling usually starts in the mid 80s.",
                      unit="celsius", width=8, needs=Needs.GPU),
            PanelSpec("GPU power", "timeseries",
                      (Target(f"robust_gpu_power_watts{{{NODES}}}", "{{node}} gpu {{gpu}}"),),
                      "Power draw. One GPU drawing much less than its peers under the same "
                      "work is throttled or starved.", unit="watt", width=8, needs=Needs.GPU),
            PanelSpec("GPU clocks", "timeseries", (
                Target(f"robust_gpu_sm_clock_hertz{{{NODES}}}", "SM {{node}} gpu {{gpu}}"),
                Target(f"robust_gpu_memory_clock_hertz{{{NODES}}}", "memory {{node}} gpu {{gpu}}"),
            ), "SM and memory clocks; a drop without a drop in load is throttling.",
               unit="hertz", width=8, needs=Needs.GPU),
            PanelSpec("Clock throttle reasons", "timeseries",
                      (Target(f"sum by (node, gpu, reason) (robust_gpu_clock_throttle{{{NODES}}})",
                              "{{node}} gpu {{gpu}} {{reason}}"),),
                      "1 while a clock-throttle reason is active. hw_slowdown and sw_thermal slow "
                      "the whole job down to this GPU's pace.", width=8, needs=Needs.GPU,
                      style=_stacked),
        )),
        Section("GPU errors", (
            PanelSpec("XID events", "timeseries",
                      (Target(f"sum by (node, gpu, xid) "
                              f"{_increase(f'robust_gpu_xid_errors_total{{{NODES}}}')}",
                              "{{node}} gpu {{gpu}} xid {{xid}}"),),
                      "Driver XID events (48: double-bit ECC, 79: fallen off the bus, 94/95: "
                      "contained/uncontained ECC). Series exist only once an XID occurred.",
                      width=8, needs=Needs.GPU_FAULT, style=_bars),
            PanelSpec("ECC errors", "timeseries",
                      (Target(f"sum by (node, gpu, type) "
                              f"{_increase(f'robust_gpu_ecc_errors_total{{{NODES}}}')}",
                              "{{node}} gpu {{gpu}} {{type}}"),),
                      "ECC errors by type. Uncorrected errors crash the job; a rising corrected "
                      "count announces them.", width=8, needs=Needs.GPU, style=_bars),
            PanelSpec("Row remaps, PCIe replays, lost GPUs", "timeseries", (
                Target(f"robust_gpu_row_remap_pending{{{NODES}}}", "remap pending {{node}} gpu {{gpu}}"),
                Target(f"robust_gpu_row_remap_failure{{{NODES}}}", "remap failed {{node}} gpu {{gpu}}"),
                Target(f"increase(robust_gpu_pcie_replays_total{{{NODES}}}[{RI}])",
                       "PCIe replays {{node}} gpu {{gpu}}"),
                Target(f"robust_gpu_lost{{{NODES}}}", "lost {{node}} gpu {{gpu}}"),
            ), "A pending remap needs a GPU reset, a failed remap a new GPU, a lost GPU fell off "
               "the bus. All zero on a healthy node.", width=8, needs=Needs.GPU),
        )),
        Section("Network", (
            PanelSpec("NIC throughput", "timeseries", (
                Target(f"rate(robust_nic_transmit_bytes_total{{{NODES}}}[{RI}])",
                       "tx {{node}} {{device}}/{{port}}"),
                Target(f"rate(robust_nic_receive_bytes_total{{{NODES}}}[{RI}])",
                       "rx {{node}} {{device}}/{{port}}"),
            ), "Bytes per second through each InfiniBand/RoCE port.", unit="Bps", width=8,
               needs=Needs.NIC),
            PanelSpec("NIC port errors", "timeseries",
                      (Target(f"sum by (node, device, port, counter) (increase("
                              f"robust_nic_port_errors_total{{{NODES}}}[{RI}]))",
                              "{{node}} {{device}}/{{port}} {{counter}}"),),
                      "Port error counters (symbol errors, link downed, receive errors).",
                      width=8, needs=Needs.NIC, style=_bars),
            PanelSpec("Link flaps and ports down", "timeseries", (
                Target(f"increase(robust_netdev_carrier_changes_total{{{NODES}}}[{RI}])",
                       "carrier changes {{node}} {{interface}}"),
                Target(f"1 - robust_nic_port_up{{{NODES}}}", "port down {{node}} {{device}}/{{port}}"),
            ), "Carrier changes of network devices and InfiniBand ports not ACTIVE. A flapping "
               "link stalls every collective that crosses it.", width=8, needs=Needs.NIC),
        )),
        Section("Sidecar and rank processes", (
            PanelSpec("Sidecar collector success", "timeseries",
                      (Target("min by (instance, collector) (robust_sidecar_collector_success)",
                              "{{instance}} {{collector}}"),),
                      "1 when the collector succeeded in the last scrape. A failing collector "
                      "costs its own series, not the scrape.", width=8, needs=Needs.SIDECAR),
            PanelSpec("Rank processes alive", "timeseries",
                      (Target(_on_nodes(f"robust_rank_process_alive{{{RANKS}}}"),
                              "rank {{rank}} ({{node}})"),),
                      "1 while the rank's process exists, seen from the sidecar.", width=8,
                      needs=Needs.SIDECAR),
            PanelSpec("Rank process memory", "timeseries",
                      (Target(_on_nodes(f"robust_rank_process_resident_memory_bytes{{{RANKS}}}"),
                              "rank {{rank}} ({{node}})"),),
                      "Resident memory of each rank process; a steady climb is a host memory "
                      "leak heading for the OOM killer.", unit="bytes", width=8, needs=Needs.SIDECAR),
        )),
    ),
)

def _action_stat(title: str, action: str) -> PanelSpec:
    return PanelSpec(
        title, "stat",
        (Target("sum " + _increase(f'robust_bridge_actions_total{{{RUN}, action="{action}", '
                             f'result!="skipped"}}', "$__range"), "", True),),
        f"{title} the bridge performed in the time range (dry runs included, skips not).",
        unit="none", width=6, height=4, needs=Needs.BRIDGE)


_ACTION_STATS = tuple(_action_stat(t, a) for t, a in (
    ("Checkpoints", "checkpoint"), ("Stack dumps", "dump_stacks"), ("Restarts", "restart"),
    ("Node drains", "drain_node")))

ACTIONS = DashboardSpec(
    uid="robust-actions",
    file="actions.json",
    title="Actions",
    description="What the action bridge did about alerts (checkpoints, stack dumps, restarts, "
                "drains), when, and with which result.",
    annotations=(_ALERTS, ("Bridge actions", "purple",
                           f"sum by (run, action, result) "
                           f"{_increase(f'robust_bridge_actions_total{{{RUN}}}', '1m')} > 0")),
    variables=("run", "node", "rank"),
    sections=(
        Section("Actions", (
            *_ACTION_STATS,
            PanelSpec("Actions over time", "timeseries",
                      (Target(f"sum by (action, result) "
                              f"{_increase(f'robust_bridge_actions_total{{{RUN}}}')}",
                              "{{action}} {{result}}"),),
                      "Actions per rate window by action and result (success, failed, skipped, "
                      "dry_run).", width=12, needs=Needs.BRIDGE, style=_bars),
            PanelSpec("Actions by result", "table",
                      (Target(f"sum by (run, action, result) "
                              f"{_increase(f'robust_bridge_actions_total{{{RUN}}}', '$__range')} > 0",
                              "", True),),
                      "Every action and result in the time range, with counts.",
                      width=12, needs=Needs.BRIDGE, style=_hide_time),
            PanelSpec("Action duration (p90)", "timeseries",
                      (Target(f"histogram_quantile(0.9, sum by (le, action) (rate("
                              f"robust_bridge_action_duration_seconds_bucket[{RI}])))", "{{action}}"),),
                      "90th percentile duration of bridge actions; a checkpoint that takes "
                      "longer than its timeout is reported failed.", unit="s", width=8,
                      needs=Needs.BRIDGE),
            PanelSpec("Webhook requests", "timeseries",
                      (Target(f"sum by (status) (rate(robust_bridge_webhook_requests_total[{RI}]))",
                              "HTTP {{status}}"),),
                      "Alertmanager webhook deliveries by HTTP status; 4xx are rejected payloads.",
                      unit="reqps", width=8, needs=Needs.BRIDGE),
            PanelSpec("Hang suspects", "table",
                      (Target(f"robust_hang_suspect{{{RUN}}} == 1", "", True),),
                      "Ranks that stack aggregation named as the outlier of a hung run.",
                      width=8, needs=Needs.HANG, style=_hide_time),
        )),
        Section("Checkpoints seen from the ranks", (
            PanelSpec("Checkpoint request acknowledged", "timeseries",
                      (Target(f"robust_checkpoint_request_id{{{RANKS}}} > 0", "rank {{rank}}"),),
                      "Id (ms since the epoch) of the last checkpoint request each rank handled; "
                      "a rank stuck on an old id did not act on the bridge's request.",
                      unit="dateTimeAsIso", width=8, needs=Needs.CHECKPOINT),
            PanelSpec("Checkpoint duration", "timeseries",
                      (Target(f"robust_checkpoint_duration_seconds{{{RANKS}}} > 0", "rank {{rank}}"),),
                      "Duration of each rank's last successful checkpoint callback.",
                      unit="s", width=8, needs=Needs.CHECKPOINT),
            PanelSpec("Checkpoint failures", "timeseries",
                      (Target(f"sum by (run) (increase(robust_checkpoint_failures_total{{{RANKS}}}[{RI}]))",
                              "{{run}}"),),
                      "Checkpoint callbacks that raised. Zero in a healthy run.", width=8,
                      style=_bars),
        )),
    ),
)

DASHBOARDS: tuple[DashboardSpec, ...] = (TRAINING_OVERVIEW, STRAGGLERS, NODE_GPU_HEALTH, ACTIONS)


# --- rendering through the SDK ------------------------------------------------------------------
def _datasource() -> Any:
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    return DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")


def _variables(names: Sequence[str]) -> list[Any]:
    """datasource, then run, node and rank: each narrows the next, all multi-select with All."""
    from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable
    from grafana_foundation_sdk.models.dashboard import VariableRefresh, VariableSort

    queries = {
        "run": ("Run", "label_values(robust_rank_info, run)", VariableSort.ALPHABETICAL_ASC),
        "node": ("Node", f"label_values(robust_rank_info{{{RUN}}}, node)",
                 VariableSort.ALPHABETICAL_ASC),
        "rank": ("Rank", f"label_values(robust_rank_info{{{RUN}, {NODES}}}, rank)",
                 VariableSort.NUMERICAL_ASC),
    }
    out: list[Any] = [DatasourceVariable(DATASOURCE_VAR).label("Data source").type("prometheus")]
    for name in names:
        label, query, sort = queries[name]
        out.append(QueryVariable(name).label(label).datasource(_datasource()).query(query)
                   .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(sort)
                   .multi(True).include_all(True).all_value(".*"))
    return out


def variable_queries(spec: DashboardSpec) -> dict[str, str]:
    """name -> label_values(...) query of the dashboard's query variables (for tests and docs)."""
    return {v.name: v.query for v in (b.build() for b in _variables(spec.variables)[1:])}


def _panel_builder(kind: str) -> Any:
    from grafana_foundation_sdk.builders import bargauge, heatmap, stat, table, timeseries

    builders = {"timeseries": timeseries.Panel, "stat": stat.Panel, "table": table.Panel,
                "heatmap": heatmap.Panel, "bargauge": bargauge.Panel}
    try:
        return builders[kind]()
    except KeyError:
        raise ValueError(f"unknown panel kind {kind!r}; known: {', '.join(builders)}") from None


def _panel(spec: PanelSpec, panel_id: int, x: int, y: int) -> Any:
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.models.dashboard import GridPos
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    builder = (_panel_builder(spec.kind).id(panel_id).title(spec.title)
               .description(spec.description).datasource(_datasource())
               .grid_pos(GridPos(h=spec.height, w=spec.width, x=x, y=y)))
    if spec.unit:
        builder = builder.unit(spec.unit)
    if spec.kind == "timeseries":  # thin lines: a run has hundreds of ranks on one panel
        builder = builder.line_width(1).fill_opacity(0)
    for i, target in enumerate(spec.targets):
        query = (Dataquery().ref_id(chr(ord("A") + i)).expr(target.expr)
                 .datasource(_datasource()))
        if target.legend:
            query = query.legend_format(target.legend)
        if target.instant:
            query = query.instant()
            if spec.kind == "table":
                query = query.format(PromQueryFormat.TABLE)
        else:
            query = query.range()
        builder = builder.with_target(query)
    if spec.style is not None:
        builder = spec.style(builder)
    return builder


def build(spec: DashboardSpec) -> Any:
    """The SDK dashboard builder of one spec, with every panel placed explicitly on the grid."""
    from grafana_foundation_sdk.builders.dashboard import (
        AnnotationQuery,
        Dashboard,
        DashboardLink,
        Row,
        TimePicker,
    )
    from grafana_foundation_sdk.models.dashboard import (
        DashboardCursorSync,
        DashboardLinkType,
        GridPos,
    )

    board = (Dashboard(spec.title).uid(spec.uid).description(spec.description)
             .tags([TAG]).editable().tooltip(DashboardCursorSync.CROSSHAIR)
             .time("now-1h", "now").refresh("30s").timezone("browser")
             .timepicker(TimePicker().refresh_intervals(["10s", "30s", "1m", "5m", "15m"]))
             .link(DashboardLink("robust-metrics").type(DashboardLinkType.DASHBOARDS)
                   .tags([TAG]).as_dropdown(True).include_vars(True).keep_time(True))
             .variables(_variables(spec.variables)))
    for name, colour, expr in spec.annotations:
        board = board.annotation(AnnotationQuery().name(name).datasource(_datasource())
                                 .enable(True).icon_color(colour).expr(expr))
    panel_id, y = 1, 0
    for section in spec.sections:
        board = board.with_row(Row(section.title).id(panel_id).grid_pos(GridPos(h=1, w=24, x=0, y=y)))
        panel_id, y = panel_id + 1, y + 1
        x, row_height = 0, 0
        for panel in section.panels:
            if not 0 < panel.width <= 24:
                raise ValueError(f"panel {panel.title!r}: width {panel.width} not in 1..24")
            if x + panel.width > 24:
                x, y, row_height = 0, y + row_height, 0
            board = board.with_panel(_panel(panel, panel_id, x, y))
            panel_id += 1
            x += panel.width
            row_height = max(row_height, panel.height)
        y += row_height
    return board


def render(spec: DashboardSpec) -> str:
    """The dashboard as Grafana JSON text: sorted keys, two-space indent, trailing newline."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return json.dumps(build(spec).build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def render_all() -> dict[str, str]:
    """file name -> JSON text of every dashboard."""
    files = {spec.file: render(spec) for spec in DASHBOARDS}
    if len(files) != len(DASHBOARDS):
        raise ValueError("two dashboards share a file name")
    return files


# --- CLI ----------------------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("dashboards"),
                        help="folder to write the dashboard JSON into (default: dashboards)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a file in --out differs from what the "
                             "generator writes, or is missing (for CI)")


def run(args: argparse.Namespace) -> int:
    try:
        files = render_all()
    except ImportError as exc:
        print(f"robust-metrics dashboards: {exc}; install the extra: "
              f"pip install 'robust-metrics[dashboards]'", file=sys.stderr)
        return 2
    out: Path = args.out
    if args.check:
        stale = [name for name, text in files.items()
                 if not (out / name).is_file() or (out / name).read_text() != text]
        if stale:
            print(f"stale dashboards in {out}: {', '.join(stale)}; regenerate with "
                  f"'robust-metrics dashboards --out {out}' and commit", file=sys.stderr)
            return 1
        print(f"{len(files)} dashboards in {out} are up to date")
        return 0
    if out.exists() and not out.is_dir():
        print(f"robust-metrics dashboards: --out {out} is not a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    print(f"wrote {len(files)} dashboards to {out}: {', '.join(files)}")
    return 0


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


def iter_targets() -> Iterator[tuple[DashboardSpec, PanelSpec, Target]]:
    """Every query of every panel, with its dashboard and panel."""
    for spec in DASHBOARDS:
        for panel in spec.panels_flat:
            for target in panel.targets:
                yield spec, panel, target
