"""The demo's report: a summary table, ETTR, PNG plots from Prometheus, and a Markdown page."""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from robust_metrics.demo.scenario import FaultRecord
from robust_metrics.demo.stack import QUERY_ERRORS, RUN, DemoStack
from robust_metrics.tables import render_table

__all__ = ["BADPUT_CAUSES", "QUERY_ERRORS", "Report", "alerts_fired", "badput", "badput_figure",
           "ettr", "ledger_table", "plot_badput", "summary_table", "write_report"]


log = logging.getLogger(__name__)


def _clock(ts: float | None) -> str:
    return "-" if ts is None else datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


@dataclass(frozen=True)
class Report:
    """What `write_report` wrote, and what it could not: failed queries make it incomplete."""

    page: Path
    errors: list[str]
    alerts_fired: list[dict[str, str]] | None  # None: the query failed (never "no alerts")


SUMMARY_HEADER = ("fault", "target", "injected", "detected", "latency", "alert", "actions",
                  "result")


def summary_table(records: list[FaultRecord]) -> str:
    """The plain-text table printed at the end: a header row, a rule, one row per fault."""
    rows = [[r.fault.name, f"rank {r.fault.rank}", _clock(r.injected_at), _clock(r.detected_at),
             "-" if r.latency is None else f"{r.latency:.1f} s",
             f"{r.fault.alert} rank={r.alert_rank or '-'}", ", ".join(r.actions) or "-",
             r.result] for r in records]
    return render_table(SUMMARY_HEADER, rows)


LEDGER_HEADER = ("incident", "alert", "outcome", "detect", "act", "recover", "lost steps",
                 "nodes")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def ledger_table(entries: list[dict[str, Any]]) -> str:
    """The bridge's incident ledger (GET /api/v1/incidents), oldest first: per fault the time
    to detect, act and recover, and the steps lost."""
    rows = [[str(e.get("incident_id", "-")), str(e.get("alertname", "-")),
             str(e.get("outcome", "-")), _seconds(e.get("detect_s")), _seconds(e.get("act_s")),
             _seconds(e.get("recover_s")),
             "-" if e.get("lost_steps") is None else str(e["lost_steps"]),
             ", ".join(e.get("nodes") or []) or "-"]
            for e in sorted(entries, key=lambda e: e.get("incident_id", 0))]
    return render_table(LEDGER_HEADER, rows)


BADPUT_CAUSES = ("productive", "hang", "restart", "recomputed", "checkpoint", "evaluation",
                 "unexplained")
"""The causes of alert_rules/badput.yml, productive first."""


def badput(stack: DemoStack, errors: list[str]) -> dict[str, float] | None:
    """Seconds per cause of the run's wall time (run:robust_badput_seconds:total)."""
    expr = f'run:robust_badput_seconds:total{{run="{RUN}"}}'
    try:
        result = stack.query(expr)
    except QUERY_ERRORS as exc:
        errors.append(f"query {expr} failed: {exc}")
        return None
    parts = {r["metric"].get("cause", ""): float(r["value"][1]) for r in result}
    return {c: parts.get(c, 0.0) for c in BADPUT_CAUSES} if parts else None


def badput_figure(parts: dict[str, float], ettr_since_start: float | None = None) -> Any:
    """One horizontal bar of the wall time, split into its causes, with the legend below the
    axis label (never over the bar or the label) and ETTR in the title beside the productive
    share, which it should match."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wall = sum(parts.values())
    colours = {"productive": "tab:green", "hang": "tab:red", "restart": "tab:orange",
               "recomputed": "tab:purple", "checkpoint": "tab:blue", "evaluation": "tab:cyan",
               "unexplained": "tab:gray"}
    fig, ax = plt.subplots(figsize=(10, 2.6), layout="constrained")
    left = 0.0
    for cause in BADPUT_CAUSES:
        width = parts.get(cause, 0.0)
        if width <= 0:
            continue
        share = width / wall if wall else 0.0
        ax.barh(0, width, left=left, color=colours[cause],
                label=f"{cause} {width:.0f} s ({100 * share:.1f}%)")
        left += width
    ax.set_yticks([])
    ax.set_xlabel("seconds of wall time")
    productive = parts.get("productive", 0.0) / wall if wall else 0.0
    title = f"Where the wall time went ({wall:.0f} s): productive {100 * productive:.1f}%"
    if ettr_since_start is not None:
        title += f", ETTR {100 * ettr_since_start:.1f}%"
    ax.set_title(title)
    fig.legend(loc="outside lower center", ncol=4, fontsize="small")
    return fig


def plot_badput(parts: dict[str, float], path: Path, ettr_since_start: float | None = None
                ) -> None:
    """Write `badput_figure` as a PNG."""
    import matplotlib.pyplot as plt

    fig = badput_figure(parts, ettr_since_start)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _scalar(stack: DemoStack, expr: str, errors: list[str]) -> float | None:
    """The query's value, None when it has no data; a failed query is added to `errors`."""
    try:
        result = stack.query(expr)
        return float(result[0]["value"][1]) if result else None
    except QUERY_ERRORS as exc:
        errors.append(f"query {expr} failed: {exc}")
        return None


def ettr(stack: DemoStack, errors: list[str]) -> dict[str, float | None]:
    """ETTR since start as productive time over wall time (the badput breakdown), and the
    estimates from unique steps x the current median step time, since start and over an hour
    (which assume a steady step time: a slow phase, valued at today's faster steps, makes them
    lower)."""
    def value(record: str) -> float | None:
        return _scalar(stack, f'{record}{{run="{RUN}"}}', errors)

    return {"since_start": value("run:robust_ettr:ratio_productive"),
            "steps_since_start": value("run:robust_ettr:ratio_since_start"),
            "1h": value("run:robust_ettr:ratio1h")}


def _series_by_rank(stack: DemoStack, expr: str, start: float, end: float,
                    step: float) -> dict[int, list[tuple[float, float]]]:
    out: dict[int, list[tuple[float, float]]] = {}
    for series in stack.query_range(expr, start, end, step):
        rank = int(series["metric"].get("rank", "-1"))
        out[rank] = [(float(t), float(v)) for t, v in series["values"]]
    return dict(sorted(out.items()))


def _plot_heatmap(data: dict[int, list[tuple[float, float]]], start: float, step: float,
                  path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ranks = sorted(data)
    n = int(max((t for pts in data.values() for t, _ in pts), default=start) - start) // int(
        step) + 1
    grid = np.full((len(ranks), max(n, 1)), np.nan)
    for i, rank in enumerate(ranks):
        for t, v in data[rank]:
            grid[i, int((t - start) // step)] = 1000 * v
    fig, ax = plt.subplots(figsize=(10, 2 + 0.4 * len(ranks)))
    image = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest",
                      extent=(0, grid.shape[1] * step, len(ranks) - 0.5, -0.5))
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds since start")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_lines(data: dict[int, list[tuple[float, float]]], start: float, path: Path, title: str,
                ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5))
    for rank, points in data.items():
        ax.plot([t - start for t, _ in points], [v for _, v in points], label=f"rank {rank}",
                linewidth=1)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _whatif(trace_dir: Path, out: Path) -> dict[str, Any] | None:
    """What-if analysis of the sampled op traces the hook recorded during the run."""
    if not any(trace_dir.glob("*.jsonl")):
        return None
    try:
        from robust_metrics.analysis.whatif import analyze_trace
        from robust_metrics.analysis.whatif.plots import write_heatmap

        result = analyze_trace(trace_dir)
        write_heatmap(result, out / "whatif-heatmap.png")
        return {"slowdown": result.slowdown, "by_dp_rank": result.by_dp_rank,
                "t_original": result.t_original, "t_ideal": result.t_ideal}
    except Exception as exc:  # the report still has everything else
        log.warning("what-if analysis of %s failed: %s", trace_dir, exc)
        return {"error": str(exc)}


def alerts_fired(stack: DemoStack, started: float, ended: float) -> list[dict[str, str]]:
    """Every (alertname, rank) that fired for the run between `started` and `ended`.

    A failed query raises (one of QUERY_ERRORS): "no alerts" must mean Prometheus said so.
    """
    window = max(1, int(ended - started) + 1)
    result = stack.query(f'group by (alertname, rank) (max_over_time(ALERTS{{run="{RUN}", '
                         f'alertstate="firing"}}[{window}s]))')
    return sorted(({k: v for k, v in r["metric"].items()} for r in result),
                  key=lambda a: (a.get("alertname", ""), a.get("rank", "")))


def write_report(stack: DemoStack, records: list[FaultRecord], started: float, ended: float,
                 out: Path, resumed_from: int | None) -> Report:
    """Write plots, `report.json` and `README.md` into `out`. The queries that failed are in
    the result's `errors` (the report is incomplete, and the demo's exit status says so)."""
    out.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    step = 2.0
    window = "10s"
    sel = f'run="{RUN}"'
    plots = {
        "step-time-heatmap.png": (
            _plot_heatmap, f"rate(robust_step_duration_seconds_sum{{{sel}}}[{window}]) / "
            f"rate(robust_step_duration_seconds_count{{{sel}}}[{window}])",
            "Step time per rank"),
        "compute-time-heatmap.png": (
            _plot_heatmap, f"rate(robust_step_compute_seconds_sum{{{sel}}}[{window}]) / "
            f"rate(robust_step_compute_seconds_count{{{sel}}}[{window}])",
            "Compute time per rank (step time minus time blocked in collectives)"),
        "loss.png": (_plot_lines, f"robust_loss{{{sel}}}", "Loss"),
        "grad-norm.png": (_plot_lines, f"robust_grad_norm{{{sel}}}", "Gradient norm"),
    }
    written = []
    for name, (plot, expr, title) in plots.items():
        try:
            data = _series_by_rank(stack, expr, started, ended, step)
        except QUERY_ERRORS as exc:
            errors.append(f"query {expr} failed: {exc}")
            continue
        try:
            if plot is _plot_heatmap:
                _plot_heatmap(data, started, step, out / name, title)
            else:
                _plot_lines(data, started, out / name, title, title.lower())
            written.append((name, title))
        except Exception as exc:
            log.warning("plot %s failed: %s", name, exc)
    whatif = _whatif(stack.job_dir / "trace" / "from-step-0", out)  # the first launch
    ettr_values = ettr(stack, errors)
    try:
        fired: list[dict[str, str]] | None = alerts_fired(stack, started, ended)
    except QUERY_ERRORS as exc:
        errors.append(f"the query for the alerts that fired failed: {exc}")
        fired = None
    incidents = _incidents(stack, errors)
    ledger = _ledger(stack, errors)
    parts = badput(stack, errors)
    if parts:
        try:
            plot_badput(parts, out / "badput.png", ettr_values["since_start"])
        except Exception as exc:
            log.warning("plot badput.png failed: %s", exc)
    summary = summary_table(records)
    document = {
        "faults": [{"fault": r.fault.name, "rank": r.fault.rank, "alert": r.fault.alert,
                    "alert_rank": r.alert_rank, "injected_at": r.injected_at,
                    "detected_at": r.detected_at, "latency_s": r.latency, "actions": r.actions,
                    "result": r.result} for r in records],
        "ettr": ettr_values, "resumed_from_step": resumed_from, "whatif": whatif,
        "alerts_fired": fired, "incidents": incidents, "ledger": ledger, "badput": parts,
        "errors": errors,
        "started": started, "ended": ended,
    }
    (out / "report.json").write_text(json.dumps(document, indent=2, default=str))
    lines = ["# robust-metrics demo report", "",
             f"Run `{RUN}`, {ended - started:.0f} s, {stack.ranks} gloo ranks.", "",
             "```", summary, "```", "",
             f"ETTR since start: {_fmt(ettr_values['since_start'])} (productive time over wall "
             f"time); from unique steps x the current median step time: "
             f"{_fmt(ettr_values['steps_since_start'])} since start, "
             f"{_fmt(ettr_values['1h'])} over the last hour.", ""]
    if resumed_from is not None:
        lines += [f"After the restart the job resumed from its checkpoint at step {resumed_from}.",
                  ""]
    if whatif and "slowdown" in whatif:
        lines += [f"What-if analysis of the sampled steps: slowdown S = {whatif['slowdown']:.3f} "
                  f"(mean step {whatif['t_original']:.3f} s, ideal {whatif['t_ideal']:.3f} s). "
                  "![what-if heatmap](whatif-heatmap.png)", ""]
    if ledger:
        lines += ["## Incident ledger", "", "From the bridge's `GET /api/v1/incidents`: per fault "
                  "the time to detect (from the fault), to act and to recover (the first step "
                  "after the action), and the steps redone.", "", "```", ledger_table(ledger),
                  "```", ""]
    if parts:
        lines += ["## Badput", "", "Wall time by cause (`run:robust_badput_seconds:total`); "
                  "its productive share is ETTR.", "", "![badput](badput.png)", ""]
    if errors:
        lines += ["## Errors", "", "This report is incomplete:", "",
                  *[f"- {e}" for e in errors], ""]
    for name, title in written:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    page = out / "README.md"
    page.write_text("\n".join(lines))
    return Report(page, errors, fired)


def _incidents(stack: DemoStack, errors: list[str]) -> list[dict[str, Any]] | None:
    try:
        return stack.actions()
    except QUERY_ERRORS as exc:
        errors.append(f"could not read the bridge's actions: {exc}")
        return None


def _ledger(stack: DemoStack, errors: list[str]) -> list[dict[str, Any]] | None:
    try:
        return stack.incidents()
    except QUERY_ERRORS as exc:
        errors.append(f"could not read the bridge's incident ledger: {exc}")
        return None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
