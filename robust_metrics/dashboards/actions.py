"""The "Actions" dashboard: what the action bridge did about alerts, when, with which result."""

from __future__ import annotations

from robust_metrics.dashboards.model import DashboardSpec, Needs, PanelSpec, Section, Target
from robust_metrics.dashboards.queries import ALERTS, NODES, RANKS, RI, RUN, increase
from robust_metrics.dashboards.styles import (
    bars,
    chain,
    hide_time,
    stacked,
    table_sorted,
    thresholds,
)


def _action_stat(title: str, action: str) -> PanelSpec:
    return PanelSpec(
        title, "stat",
        (Target("sum " + increase(f'robust_bridge_actions_total{{{RUN}, action="{action}", '
                            f'result!="skipped"}}', "$__range"), "", True),),
        f"{title} the bridge performed in the time range (dry runs included, skips not).",
        unit="none", width=6, height=4, needs=Needs.BRIDGE)


def _incident_quantile(stage: str) -> Target:
    return Target(f"histogram_quantile(0.5, sum by (le, alertname) (increase("
                  f"robust_bridge_incident_{stage}_seconds_bucket[$__range])))",
                  f"{stage} {{{{alertname}}}}", True)


_INCIDENTS = Section("Incidents, suspect nodes and badput", (
    PanelSpec("Time to detect, act and recover (median)", "table",
              tuple(_incident_quantile(s) for s in ("detect", "act", "recover")),
              "Incident ledger, median by alert over the time range: detect is fault (a hang's "
              "last step, else the alert's start) to the bridge receiving the alert; act is "
              "to the remedial step finishing; recover is to the run's first step after it. "
              "Per incident: GET /api/v1/incidents on the bridge.",
              unit="s", width=8, needs=Needs.INCIDENT, style=hide_time),
    PanelSpec("Incidents and lost steps", "table",
              (Target("sum by (alertname, outcome) "
                      + increase("robust_bridge_incidents_total", "$__range") + " > 0",
                      "", True),
               Target("sum by (alertname) "
                      + increase("robust_bridge_incident_lost_steps_total", "$__range"),
                      "", True)),
              "Incidents the ledger entered by alert and outcome (recovered, crash_loop, "
              "not_recovered, no_restart, drained), and the steps redone after resuming from a "
              "checkpoint.", width=8, needs=Needs.INCIDENT, style=hide_time),
    PanelSpec("Suspect nodes", "table",
              (Target(f"max by (node) (robust_bridge_node_incidents{{{NODES}}}) > 0", "", True),),
              "Incidents that named each node within the bridge's node window, across runs. "
              "SuspectNode flags a node at 3 that has 3x the other nodes' mean.",
              width=8, needs=Needs.INCIDENT,
              style=chain(hide_time, table_sorted("Value"),
                          thresholds((None, "green"), (2, "orange"), (3, "red")))),
    PanelSpec("Badput: wall time by cause", "timeseries",
              (Target(f"sum by (cause) (run:robust_badput_seconds:total{{{RUN}}})",
                      "{{cause}}"),),
              "Seconds of the run's wall time by cause (alert_rules/badput.yml): productive, "
              "hang before the restart, restart to the first step, recomputed steps, "
              "checkpoint, evaluation, unexplained. The causes add up to the wall time.",
              unit="s", width=12, needs=Needs.TRAINING, style=stacked),
    PanelSpec("Badput share", "timeseries",
              (Target(f"run:robust_badput_seconds:ratio{{{RUN}, cause!=\"productive\"}}",
                      "{{run}} {{cause}}"),
               Target(f"run:robust_ettr:ratio_productive{{{RUN}}}", "{{run}} ETTR")),
              "Share of the wall time lost to each cause, and ETTR (productive share).",
              unit="percentunit", width=12, needs=Needs.TRAINING),
))

_ACTION_STATS = tuple(_action_stat(t, a) for t, a in (
    ("Checkpoints", "checkpoint"), ("Stack dumps", "dump_stacks"), ("Restarts", "restart"),
    ("Node drains", "drain_node")))

ACTIONS = DashboardSpec(
    uid="robust-actions",
    file="actions.json",
    title="Actions",
    description="What the action bridge did about alerts (checkpoints, stack dumps, restarts, "
                "drains), when, and with which result.",
    annotations=(ALERTS, ("Bridge actions", "purple",
                           f"sum by (run, action, result) "
                           f"{increase(f'robust_bridge_actions_total{{{RUN}}}', '1m')} > 0")),
    variables=("run", "node", "rank"),
    sections=(
        Section("Actions", (
            *_ACTION_STATS,
            PanelSpec("Actions over time", "timeseries",
                      (Target(f"sum by (action, result) "
                              f"{increase(f'robust_bridge_actions_total{{{RUN}}}')}",
                              "{{action}} {{result}}"),),
                      "Actions per rate window by action and result (success, failed, skipped, "
                      "dry_run).", width=12, needs=Needs.BRIDGE, style=bars),
            PanelSpec("Actions by result", "table",
                      (Target(f"sum by (run, action, result) "
                              f"{increase(f'robust_bridge_actions_total{{{RUN}}}', '$__range')} > 0",
                              "", True),),
                      "Every action and result in the time range, with counts.",
                      width=12, needs=Needs.BRIDGE, style=hide_time),
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
                      width=8, needs=Needs.HANG, style=hide_time),
        )),
        _INCIDENTS,
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
                      style=bars),
        )),
    ),
)
