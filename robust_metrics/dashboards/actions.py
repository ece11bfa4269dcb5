"""The "Actions" dashboard: what the action bridge did about alerts, when, with which result."""

from __future__ import annotations

from robust_metrics.dashboards.model import DashboardSpec, Needs, PanelSpec, Section, Target
from robust_metrics.dashboards.queries import ALERTS, RANKS, RI, RUN, increase
from robust_metrics.dashboards.styles import bars, hide_time


def _action_stat(title: str, action: str) -> PanelSpec:
    return PanelSpec(
        title, "stat",
        (Target("sum " + increase(f'robust_bridge_actions_total{{{RUN}, action="{action}", '
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
