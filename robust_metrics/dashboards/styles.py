"""Panel styles: functions that adjust an SDK panel builder (points, log scale, bars, thresholds).

A style never changes a panel's queries; `PanelSpec.style` names one, `render.py` applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def points(builder: Any) -> Any:
    """Lines with every sample drawn, so a single-step spike is visible at any zoom."""
    from grafana_foundation_sdk.models.common import VisibilityMode

    return builder.show_points(VisibilityMode.ALWAYS).point_size(4)


def log_scale(builder: Any) -> Any:
    from grafana_foundation_sdk.builders.common import ScaleDistributionConfig
    from grafana_foundation_sdk.models.common import ScaleDistribution, VisibilityMode

    return (builder.scale_distribution(ScaleDistributionConfig().type(ScaleDistribution.LOG).log(10))
            .show_points(VisibilityMode.ALWAYS).point_size(4))


def bars(builder: Any) -> Any:
    from grafana_foundation_sdk.models.common import GraphDrawStyle

    return builder.draw_style(GraphDrawStyle.BARS).fill_opacity(80)


def stacked(builder: Any) -> Any:
    from grafana_foundation_sdk.builders.common import StackingConfig
    from grafana_foundation_sdk.models.common import StackingMode

    return builder.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(40)


def thresholds(*steps: tuple[float | None, str]) -> Callable[[Any], Any]:
    def apply(builder: Any) -> Any:
        from grafana_foundation_sdk.builders.dashboard import ThresholdsConfig
        from grafana_foundation_sdk.models.dashboard import Threshold, ThresholdsMode

        return builder.thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
            [Threshold(value=v, color=c) for v, c in steps]))
    return apply


ETTR_COLOURS = thresholds((None, "red"), (0.8, "orange"), (0.9, "green"))
ZERO_GOOD = thresholds((None, "green"), (1, "red"))


def heatmap(builder: Any) -> Any:
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


def table_sorted(column: str) -> Callable[[Any], Any]:
    def apply(builder: Any) -> Any:
        from grafana_foundation_sdk.builders.common import TableSortByFieldState

        return builder.sort_by([TableSortByFieldState().display_name(column).desc(True)])
    return apply


def hide_time(builder: Any) -> Any:
    """Instant tables: drop the Time column, keep labels and the value."""
    from grafana_foundation_sdk.models.dashboard import DataTransformerConfig

    return builder.with_transformation(DataTransformerConfig(
        id_val="organize", options={"excludeByName": {"Time": True, "__name__": True}}))


def chain(*styles: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def apply(builder: Any) -> Any:
        for s in styles:
            builder = s(builder)
        return builder
    return apply


def matrix(rows: str, columns: str) -> Callable[[Any], Any]:
    """An instant table pivoted into a grid (`rows` x `columns` labels), cells coloured by value
    from 0.5 (blue) through 1.0 to 1.5 (red): a heatmap over two labels instead of time."""
    def apply(builder: Any) -> Any:
        from grafana_foundation_sdk.builders.dashboard import FieldColor
        from grafana_foundation_sdk.models.common import (
            TableCellBackgroundDisplayMode,
            TableColoredBackgroundCellOptions,
        )
        from grafana_foundation_sdk.models.dashboard import DataTransformerConfig, FieldColorModeId

        return (builder.with_transformation(DataTransformerConfig(
                    id_val="groupingToMatrix",
                    options={"rowField": rows, "columnField": columns, "valueField": "Value"}))
                .cell_options(TableColoredBackgroundCellOptions(
                    mode=TableCellBackgroundDisplayMode.GRADIENT))
                .color_scheme(FieldColor().mode(FieldColorModeId.CONTINUOUS_BL_YL_RD))
                .min(0.5).max(1.5).decimals(2))
    return apply


def names(builder: Any) -> Any:
    """A stat that shows each series' legend (a class label such as the verdict), not a number."""
    from grafana_foundation_sdk.models.common import BigValueColorMode, BigValueTextMode

    return builder.text_mode(BigValueTextMode.NAME).color_mode(BigValueColorMode.NONE)
