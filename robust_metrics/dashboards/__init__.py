"""The Grafana dashboards, built with grafana-foundation-sdk and written as committed JSON.

    robust-metrics dashboards --out dashboards/           # write dashboards/*.json
    robust-metrics dashboards --out dashboards/ --check   # exit 1 when the committed JSON is stale

Dashboards are declared as data first (`DashboardSpec` of `PanelSpec`s, each with its PromQL and
what the panel needs to show data, `Needs`), then rendered through the SDK's builders:

    model.py              DashboardSpec, Section, PanelSpec, Target, Needs (no SDK)
    queries.py            variable selectors, PromQL helpers, recording-rule names, `expand`
    styles.py             panel styles applied to SDK builders
    training_overview.py, stragglers.py, node_gpu_health.py, actions.py: one dashboard each
    catalog.py            DASHBOARDS and `iter_targets`
    render.py             the SDK builders and the JSON text
    cli.py                `robust-metrics dashboards`

A new dashboard is a new module declaring one `DashboardSpec`, listed in `catalog.DASHBOARDS`.
"""

from __future__ import annotations

from robust_metrics.dashboards.actions import ACTIONS
from robust_metrics.dashboards.catalog import DASHBOARDS, iter_targets
from robust_metrics.dashboards.model import DashboardSpec, Needs, PanelSpec, Section, Target
from robust_metrics.dashboards.node_gpu_health import NODE_GPU_HEALTH
from robust_metrics.dashboards.queries import GRAFANA_BUILTINS, expand
from robust_metrics.dashboards.render import build, render, render_all, variable_queries
from robust_metrics.dashboards.stragglers import STRAGGLERS
from robust_metrics.dashboards.training_overview import TRAINING_OVERVIEW

__all__ = [
    "ACTIONS",
    "DASHBOARDS",
    "GRAFANA_BUILTINS",
    "NODE_GPU_HEALTH",
    "STRAGGLERS",
    "TRAINING_OVERVIEW",
    "DashboardSpec",
    "Needs",
    "PanelSpec",
    "Section",
    "Target",
    "build",
    "expand",
    "iter_targets",
    "render",
    "render_all",
    "variable_queries",
]
