"""Dashboards as data: a dashboard is sections of panels, each panel its queries and what it needs.

Keeping the declaration as data lets the tests run every query against a real Prometheus and know
which panels show only faults, without parsing Grafana JSON back into intent. Nothing here imports
the Grafana SDK; `render.py` turns these into its builders.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
    INCIDENT = "incident"  # the bridge's ledger has entered an incident that named a node
    SELFTEST = "selftest"  # a sidecar has run a node self-test (POST /control/selftest)


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
