"""The demo report's incident ledger and badput breakdown, from fake answers of Prometheus and
the bridge: the ledger table per fault, the badput parts (missing causes are 0), the bar plot,
and both in `report.json` and the Markdown page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from robust_metrics.demo.report import (
    BADPUT_CAUSES,
    LEDGER_HEADER,
    badput,
    badput_figure,
    ledger_table,
    plot_badput,
    write_report,
)
from robust_metrics.processes import ServiceError

ENTRIES = [
    {"incident_id": 7, "alertname": "TrainingHang", "outcome": "recovered", "detect_s": 41.5,
     "act_s": 3.25, "recover_s": 12.0, "lost_steps": 2, "nodes": ["n1"]},
    {"incident_id": 3, "alertname": "LossSpike", "outcome": "no_restart", "detect_s": 5.0,
     "act_s": 0.5, "recover_s": None, "lost_steps": None, "nodes": []},
]
PARTS = {"productive": 825.0, "hang": 180.0, "restart": 90.0, "recomputed": 210.0,
         "checkpoint": 60.0, "evaluation": 60.0}


class FakeStack:
    """Answers what the report asks: an instant query by expression, the bridge's lists."""

    ranks = 2

    def __init__(self, tmp: Path, answers: dict[str, list[dict[str, Any]]]) -> None:
        self.answers = answers
        self.job_dir = tmp / "job"

    def query(self, expr: str) -> list[dict[str, Any]]:
        for key, value in self.answers.items():
            if expr.startswith(key):
                return value
        return []

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Any]:
        return []

    def actions(self) -> list[dict[str, Any]]:
        return []

    def incidents(self) -> list[dict[str, Any]]:
        return ENTRIES


def _badput_answer() -> list[dict[str, Any]]:
    return [{"metric": {"run": "demo", "cause": c}, "value": [0, str(v)]}
            for c, v in PARTS.items()]


def test_the_ledger_table_lists_each_fault_oldest_first() -> None:
    lines = ledger_table(ENTRIES).splitlines()
    assert lines[0].split() == ["incident", "alert", "outcome", "detect", "act", "recover",
                                "lost", "steps", "nodes"]
    assert len(LEDGER_HEADER) == 8 and len(lines) == 4
    assert lines[2].split() == ["3", "LossSpike", "no_restart", "5.0", "s", "0.5", "s", "-",
                                "-", "-"]
    assert lines[3].split() == ["7", "TrainingHang", "recovered", "41.5", "s", "3.2", "s",
                                "12.0", "s", "2", "n1"]


def test_badput_parts_fill_missing_causes_and_report_failed_queries(tmp_path: Path) -> None:
    errors: list[str] = []
    parts = badput(FakeStack(tmp_path, {"run:robust_badput_seconds:total": _badput_answer()}),
                   errors)  # type: ignore[arg-type]
    assert parts == {**PARTS, "unexplained": 0.0} and list(parts) == list(BADPUT_CAUSES)
    assert errors == []
    assert badput(FakeStack(tmp_path, {}), errors) is None  # type: ignore[arg-type]

    class Dead(FakeStack):
        def query(self, expr: str) -> list[dict[str, Any]]:
            raise ServiceError("Prometheus is not started")

    assert badput(Dead(tmp_path, {}), errors) is None  # type: ignore[arg-type]
    assert errors and "run:robust_badput_seconds:total" in errors[0]


def test_the_badput_plot_is_a_png(tmp_path: Path) -> None:
    plot_badput({**PARTS, "unexplained": 0.0}, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_badput_legend_covers_neither_the_bar_nor_the_axis_label() -> None:
    """Seven causes in the legend: it sits below the axis label, apart from the bar, the tick
    labels and the label; the title gives ETTR beside the productive share it must match."""
    import matplotlib.pyplot as plt

    fig = badput_figure({**PARTS, "unexplained": 5.0}, ettr_since_start=0.571)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        legend = fig.legends[0].get_window_extent(renderer)
        covered = [ax.get_window_extent(renderer), ax.xaxis.label.get_window_extent(renderer),
                   *(t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text())]
        assert not any(legend.overlaps(box) for box in covered)
        assert len(fig.legends[0].get_texts()) == len(BADPUT_CAUSES)
        assert ax.get_title() == "Where the wall time went (1430 s): productive 57.7%, ETTR 57.1%"
    finally:
        plt.close(fig)


def test_the_report_shows_the_ledger_and_the_badput_plot(tmp_path: Path) -> None:
    stack = FakeStack(tmp_path, {"run:robust_badput_seconds:total": _badput_answer(),
                                 "group by (alertname, rank)": []})
    report = write_report(stack, [], 1000.0, 2425.0, tmp_path / "r", None)  # type: ignore[arg-type]
    document = json.loads((tmp_path / "r" / "report.json").read_text())
    assert document["ledger"] == ENTRIES
    assert document["badput"] == {**PARTS, "unexplained": 0.0}
    assert sum(document["badput"].values()) == 1425.0
    page = report.page.read_text()
    assert "## Incident ledger" in page and "TrainingHang" in page
    assert "![badput](badput.png)" in page and (tmp_path / "r" / "badput.png").is_file()
