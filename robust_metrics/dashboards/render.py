"""Rendering through grafana-foundation-sdk: variables, panels on the grid, the Grafana JSON text.

The SDK is imported inside the functions, so importing the dashboards (tests, docs) does not need
the `dashboards` extra. The JSON targets Grafana 11.6 (the SDK's version); it imports into Grafana
10.4 and later.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from robust_metrics.dashboards.catalog import DASHBOARDS
from robust_metrics.dashboards.model import DashboardSpec, PanelSpec
from robust_metrics.dashboards.queries import NODES, RUN

GRAFANA_VERSION = "11.6"
TAG = "robust-metrics"
DATASOURCE_VAR = "datasource"


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
