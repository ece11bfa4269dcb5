"""The promtool cases of the statistical slow-rank test and of StragglerSlowdownHigh, on seeded
random series.

    .venv/bin/python -m tests.straggler_stat_cases   # rewrites alert_rules/tests/stragglers_stat_test.yml

Constant counters cannot show that a rule is quiet on noise, so these cases draw their series
(robust_metrics/workloads/straggler_series.py: 0.6 s compute +-10% uniform jitter per rank and
step, 0.4 s transfer, a bulk-synchronous step, scrapes every 15 s) and state what SlowRank and
StragglerSlowdownHigh (the run's slowdown, attribution.yml) must do over them. The YAML file is
generated from this module and committed; tests/test_straggler_stat.py fails when the two differ,
and the promtool run in tests/test_rules.py judges the file.

A silent span checks its alert at every evaluation: an alert that fires for a single evaluation
fails it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from robust_metrics import rules
from robust_metrics.workloads.straggler_series import (
    SCRAPE_S,
    Scenario,
    promtool_file,
    promtool_series,
)

__all__ = ["CASES", "PATH", "Case", "render"]

PATH = Path(__file__).resolve().parent.parent / "alert_rules" / "tests" / "stragglers_stat_test.yml"
RULE_FILES = ("../node_summaries.yml", "../training.yml", "../stragglers.yml", "../attribution.yml")
RUNBOOK = f"{rules.RUNBOOK_BASE}#slowrank"
SUMMARY = "One rank computes markedly slower than the run's median rank."
SLOWDOWN = "StragglerSlowdownHigh"


@dataclass(frozen=True)
class Case:
    """A run and what SlowRank does over it.

    `silent` = (from, to) in seconds: SlowRank fires for no rank at any evaluation in it.
    `named` = (at, rank, ratio text): at `at` seconds SlowRank fires for that rank alone, with
    the ratio its description gives. `run_silent`: spans in which StragglerSlowdownHigh does not
    fire; `flagged` = (at, labels): at `at` seconds it fires with these labels besides run,
    severity and action (verdict, and rank and node or pp_rank). `exprs`: promql_expr_test
    entries (expr, at, labels, value).
    """

    title: str
    run: str
    scenario: Scenario
    silent: list[tuple[float, float]] = field(default_factory=list)
    named: list[tuple[float, int, str]] = field(default_factory=list)
    run_silent: list[tuple[float, float]] = field(default_factory=list)
    flagged: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    exprs: list[tuple[str, float, str, float]] = field(default_factory=list)


CASES = [
    Case("a rank 1.1x slower from 5m is named within 5 minutes of the change (the fixed 1.2 "
         "ratio never names it)", "a",
         Scenario(ranks=8, minutes=10, slow={3: (1.1, 300.0)}, seed=1),
         run_silent=[(15, 600)], silent=[(15, 420)], named=[(555, 3, "1.10")],
         exprs=[("count by (run, rank) (run_rank:robust_step_compute_seconds:slow1m)", 555,
                 '{run="a",rank="3"}', 1)]),
    Case("a rank 1.3x slower from 5m is named within 2 minutes (the fixed-ratio branch)", "b",
         Scenario(ranks=8, minutes=7, slow={5: (1.3, 300.0)}, seed=2),
         silent=[(15, 360)], named=[(405, 5, "1.30")],
         exprs=[("count by (run, rank) (run_rank:robust_step_compute_seconds:over_ratio1m)", 405,
                 '{run="b",rank="5"}', 1)]),
    Case("a rank 1.05x slower: significantly above its peers (z over 3) and recorded, but "
         "below the 5% a rank may differ by: never named", "c",
         Scenario(ranks=8, minutes=20, slow={2: (1.05, 120.0)}, seed=3),
         run_silent=[(15, 1200)], silent=[(15, 1200)],
         exprs=[('run_rank:robust_step_compute_seconds:zscore1m{rank="2"} > bool 3', 600,
                 '{run="c",rank="2"}', 1),
                ("absent(run_rank:robust_step_compute_seconds:slow1m)", 600, "{}", 1)]),
    Case("a healthy run with +-10% jitter per step on every rank: silent; the spread is the "
         "jitter's (0.6 s x 0.1 / sqrt(3) = 0.035 s), every rank has a z", "d",
         Scenario(ranks=8, minutes=20, seed=4),
         run_silent=[(15, 1200)], silent=[(15, 1200)],
         exprs=[("(run:robust_step_compute_seconds:stddev1m > 0.03) < bool 0.04", 600,
                 '{run="d"}', 1),
                # the ranks' coefficient of variation, 0.1 / sqrt(3), their median as a node's
                ('(robust_node_step_compute_variation_ratio{quantile="0.5"} > 0.05) < bool 0.065',
                 600, '{run="d",window="1m",quantile="0.5"}', 1),
                ("count by (run) (run_rank:robust_step_compute_seconds:zscore1m)", 600,
                 '{run="d"}', 8)]),
    Case("CPU contention that moves to another rank every minute (1.25x, as seen on a busy "
         "2-core machine): spread, no rank named", "e",
         Scenario(ranks=8, minutes=20, contention=(1.25, 60.0, 120.0), seed=5),
         run_silent=[(15, 1200)], silent=[(15, 1200)]),
    Case("the same contention at 1.3x: the statistical test passes on each contended rank for "
         "a while, never for 75% of 3 minutes", "f",
         Scenario(ranks=8, minutes=20, contention=(1.3, 60.0, 120.0), seed=6),
         run_silent=[(15, 1200)], silent=[(15, 1200)],
         exprs=[("count by (run) (count_over_time(run_rank:robust_step_compute_seconds:slow1m"
                 "[20m]))", 1200, '{run="f"}', 8)]),
    Case("a rank 1.1x slower from the start, named, silent through a checkpoint (6m-9m) and "
         "for 2m30s after it (the test starts afresh), then named again", "g",
         Scenario(ranks=8, minutes=14, slow={1: (1.1, 0.0)}, pause=(360.0, 540.0), seed=7),
         run_silent=[(15, 840)], silent=[(15, 180), (375, 675)], named=[(300, 1, "1.10"), (825, 1, "1.11")]),
    Case("the same through an eval phase (6m-8m): silent while it lasts", "j",
         Scenario(ranks=8, minutes=9, slow={1: (1.1, 0.0)}, pause=(360.0, 480.0),
                  pause_phase="eval", seed=10),
         run_silent=[(15, 540)], silent=[(15, 180), (375, 540)], named=[(285, 1, "1.10")]),
    Case("a tiny model: 2 ms of compute in 1 s steps, one rank 2x slower; the excess is 0.2% "
         "of a step, under the 3% the test needs", "h",
         Scenario(ranks=8, minutes=10, base=0.002, transfer=0.998, slow={1: (2.0, 0.0)},
                  seed=8),
         run_silent=[(15, 600)], silent=[(15, 600)]),
    Case("a rank 1.5x slower in the job's first minute only (warm-up): silent", "i",
         Scenario(ranks=8, minutes=8, slow={0: (1.5, 0.0)}, slow_until=60.0, seed=9),
         run_silent=[(15, 480)], silent=[(15, 480)]),
    Case("a job slowed 1.13x by one rank 1.25x slower from 5m: StragglerSlowdownHigh flags it "
         "within 4 minutes as a worker straggler, with the rank and its node", "k",
         Scenario(ranks=8, minutes=10, slow={3: (1.25, 300.0)}, seed=18),
         run_silent=[(15, 510)], flagged=[(525, {"verdict": "worker", "rank": "3", "node": "n3"})]),
    Case("two ranks 1.25x slower from the start: no few workers explain it, flagged as spread "
         "once the run has stepped 3 minutes (its warm-up out of the window) and 2 more",
         "l", Scenario(ranks=8, minutes=8, slow={2: (1.25, 0.0), 5: (1.25, 0.0)}, seed=13),
         run_silent=[(15, 300)], flagged=[(315, {"verdict": "spread"}), (480, {"verdict": "spread"})]),
    Case("contention that moves to another rank every minute at 2x: a different worker each "
         "minute, one rank at a time over the last minute: StragglerSlowdownHigh silent; "
         "SlowRank silent once a second rank was its candidate (only the first contended "
         "minute, which nothing tells from a new straggler, may be named)", "m",
         Scenario(ranks=8, minutes=20, contention=(2.0, 60.0, 120.0), seed=14),
         run_silent=[(15, 1200)], silent=[(15, 120), (300, 1200)]),
    Case("the same at 1.4x: the fixed 1.2 ratio passes on each contended rank for a minute, "
         "longer than its 45 s hold; SlowRank silent once a second rank was its candidate",
         "p", Scenario(ranks=8, minutes=20, contention=(1.4, 60.0, 120.0), seed=15),
         run_silent=[(15, 1200)], silent=[(15, 120), (300, 1200)],
         exprs=[("count by (run) (count_over_time(run_rank:robust_step_compute_seconds:"
                 "over_ratio1m[20m]))", 1200, '{run="p"}', 8)]),
    Case("a rank stopped for 20 s at 5m (under the 30 s hang threshold), then resumed: its one "
         "long step is no straggler, StragglerSlowdownHigh silent", "n",
         Scenario(ranks=8, minutes=12, stall=(2, 300.0, 20.0), seed=21),
         run_silent=[(15, 720)]),
    Case("the same stop for 90 s (3x the hang threshold): silent after it ends", "o",
         Scenario(ranks=8, minutes=12, stall=(2, 300.0, 90.0), seed=23),
         run_silent=[(15, 720)]),
]


def _time(seconds: float) -> str:
    return rules.format_duration(int(seconds * 1000))


def _named(case: Case, at: float, rank: int, ratio: str) -> dict[str, Any]:
    return {"eval_time": _time(at), "alertname": "SlowRank", "exp_alerts": [{
        "exp_labels": {"severity": "warning", "action": "checkpoint", "run": case.run,
                       "rank": str(rank), "node": f"n{rank}"},
        "exp_annotations": {
            "summary": SUMMARY,
            "description": f"Run {case.run}: rank {rank} on node n{rank} spends {ratio}x the "
                           "run's median compute time per step, and every other rank waits for "
                           "it in the next collective.",
            "runbook_url": RUNBOOK}}]}


def _test(case: Case) -> dict[str, Any]:
    checks = [_named(case, *n) for n in case.named]
    for alertname, spans in (("SlowRank", case.silent), (SLOWDOWN, case.run_silent)):
        checks += [{"eval_time": _time(t), "alertname": alertname, "exp_alerts": []}
                   for start, end in spans
                   for t in range(int(start), int(end) + 1, int(SCRAPE_S))]
    checks.sort(key=lambda c: rules.parse_duration(c["eval_time"]))
    test: dict[str, Any] = {"name": case.title, "interval": "15s",
                            "input_series": promtool_series(case.scenario, case.run),
                            "alert_rule_test": checks}
    exprs = case.exprs + [_flagged(case, at, labels) for at, labels in case.flagged]
    if exprs:
        test["promql_expr_test"] = [
            {"expr": expr, "eval_time": _time(at), "exp_samples": [{"labels": labels,
                                                                    "value": value}]}
            for expr, at, labels, value in exprs]
    return test


def _flagged(case: Case, at: float, labels: dict[str, str]) -> tuple[str, float, str, float]:
    """StragglerSlowdownHigh firing at `at` for the run alone, with `labels`."""
    expr = (f"count by (run, {', '.join(labels)}) "
            f'(ALERTS{{alertname="{SLOWDOWN}",alertstate="firing"}})')
    text = ",".join(f'{k}="{v}"' for k, v in {"run": case.run, **labels}.items())
    return expr, at, f"{{{text}}}", 1


def render() -> str:
    """The promtool test file, as committed."""
    header = ("# Generated by `python -m tests.straggler_stat_cases` from seeded random series "
              "(robust_metrics/workloads/straggler_series.py). Do not edit.\n"
              "# promtool test rules alert_rules/tests/stragglers_stat_test.yml\n")
    return promtool_file(header, RULE_FILES, [_test(c) for c in CASES])


def main() -> int:
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
