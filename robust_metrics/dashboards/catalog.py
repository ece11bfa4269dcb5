"""The dashboards the project ships, in the order Grafana lists them, and every query they run."""

from __future__ import annotations

from collections.abc import Iterator

from robust_metrics.dashboards.actions import ACTIONS
from robust_metrics.dashboards.model import DashboardSpec, PanelSpec, Target
from robust_metrics.dashboards.node_gpu_health import NODE_GPU_HEALTH
from robust_metrics.dashboards.stragglers import STRAGGLERS
from robust_metrics.dashboards.training_overview import TRAINING_OVERVIEW

DASHBOARDS: tuple[DashboardSpec, ...] = (TRAINING_OVERVIEW, STRAGGLERS, NODE_GPU_HEALTH, ACTIONS)


def iter_targets() -> Iterator[tuple[DashboardSpec, PanelSpec, Target]]:
    """Every query of every panel, with its dashboard and panel."""
    for spec in DASHBOARDS:
        for panel in spec.panels_flat:
            for target in panel.targets:
                yield spec, panel, target
