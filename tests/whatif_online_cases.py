"""The study's own trace online: the promtool case that puts the published trace ST through the
shipped rules and holds their S and verdict to `robust-metrics whatif` on the same trace.

    .venv/bin/python -m tests.whatif_online_cases   # rewrites alert_rules/tests/whatif_st_test.yml

The trace (tests/fixtures/whatif-ST: dp 2 x pp 4, 32 sampled steps of a job slowed by a heavy
last stage) is played end to end and over again as the series its 8 ranks' hooks would have
published, scraped every 15 s (robust_metrics/workloads/trace_series.py). The what-if figures
(S, the verdict, the worst stage and its S_g) are computed here from the same trace and written
into the checks, which promtool evaluates at every minute from 5 to 12 (the 5-minute windows
full, the cycle of sampled steps at different phases):

- the online S (`run:robust_straggler_slowdown:ratio5m`) within 10% of the what-if's S;
- the online verdict (`run:robust_straggler_verdict:class5m`) is the what-if's, alone;
- the stage the rules find slowest is the what-if's, and its S_g within 10% of the what-if's;
- StragglerSlowdownHigh is silent through minute 5 and fires by minute 6 with the what-if's
  verdict and stage as labels (the run stepped 3 minutes at 3m15s, then the 2-minute hold);
- SlowRank names no rank at any evaluation from minute 2 to 12: the heavy last stage is a stage
  straggler (the verdict above), and its healthy ranks are not slow ranks to checkpoint for.

The YAML file is generated from this module and committed; tests/test_whatif_online.py fails when
the two differ and runs promtool on it (as does the promtool run in tests/test_rules.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from robust_metrics import rules
from robust_metrics.analysis.whatif import WhatIfResult, analyze, load_model
from robust_metrics.analysis.whatif.report import verdict
from robust_metrics.workloads.straggler_series import promtool_file
from robust_metrics.workloads.trace_series import promtool_series

__all__ = ["CHECK_MINUTES", "FIRING_AT", "PATH", "RUN", "SLOW_RANK_SILENT", "ST", "TOLERANCE",
           "render", "whatif"]

PATH = Path(__file__).resolve().parent.parent / "alert_rules" / "tests" / "whatif_st_test.yml"
ST = Path(__file__).resolve().parent / "fixtures" / "whatif-ST"
RULE_FILES = ("../node_summaries.yml", "../training.yml", "../stragglers.yml", "../attribution.yml")
RUN = "st"
MINUTES = 12
CHECK_MINUTES = range(5, MINUTES + 1)
FIRING_AT = 6  # minutes: pending from 3m15s (3 minutes of steps), then `for: 2m`
TOLERANCE = 0.10
SLOW_RANK_SILENT = (120, MINUTES * 60)  # seconds: SlowRank fires at no evaluation in between


def whatif() -> WhatIfResult:
    """`robust-metrics whatif` on the trace ST."""
    return analyze(load_model(ST / "trace-ST.parquet", ST / "meta-ST.yaml"))


def _sample(expr: str, minute: int, labels: str, value: float = 1) -> dict[str, Any]:
    return {"expr": expr, "eval_time": f"{minute}m",
            "exp_samples": [{"labels": labels, "value": value}]}


def _checks(result: WhatIfResult) -> list[dict[str, Any]]:
    s = round(result.slowdown, 4)
    stage = next(iter(result.by_stage or {}))
    stage_s = round((result.by_stage or {})[stage], 4)
    run = f'run="{RUN}"'
    out = []
    for minute in CHECK_MINUTES:
        out += [
            _sample(f"abs(run:robust_straggler_slowdown:ratio5m / {s} - 1) <= bool {TOLERANCE}",
                    minute, f"{{{run}}}"),
            _sample("run:robust_straggler_verdict:class5m", minute,
                    f'run:robust_straggler_verdict:class5m{{{run},verdict="{verdict(result)}"}}'),
            _sample("count by (run, pp_rank) "
                    "(topk by (run) (1, run_stage:robust_straggler_slowdown:ratio5m))",
                    minute, f'{{{run},pp_rank="{stage}"}}'),
            _sample(f'abs(run_stage:robust_straggler_slowdown:ratio5m{{pp_rank="{stage}"}} '
                    f"/ {stage_s} - 1) <= bool {TOLERANCE}", minute,
                    f'{{{run},pp_rank="{stage}"}}'),
        ]
    firing = 'ALERTS{alertname="StragglerSlowdownHigh",alertstate="firing"}'
    out.append(_sample(f"absent({firing})", FIRING_AT - 1,
                       '{alertname="StragglerSlowdownHigh",alertstate="firing"}'))
    out.append(_sample(f"count by (run, verdict, pp_rank) ({firing})", FIRING_AT,
                       f'{{{run},verdict="{verdict(result)}",pp_rank="{stage}"}}'))
    return out


def _slow_rank_silent() -> list[dict[str, Any]]:
    """SlowRank at every evaluation of SLOW_RANK_SILENT: no alert."""
    start, end = SLOW_RANK_SILENT
    return [{"eval_time": rules.format_duration(t * 1000), "alertname": "SlowRank",
             "exp_alerts": []} for t in range(start, end + 1, 15)]


def render() -> str:
    """The promtool test file, as committed."""
    model = load_model(ST / "trace-ST.parquet", ST / "meta-ST.yaml")
    result = analyze(model)
    title = (f"the published trace ST as its 8 ranks' series: the online S is within "
             f"{TOLERANCE:.0%} of the what-if's {result.slowdown:.4f} and the verdict is the "
             f"what-if's ({verdict(result)}, stage {next(iter(result.by_stage or {}))})")
    test = {"name": title, "interval": "15s",
            "input_series": promtool_series(model, RUN, MINUTES),
            "promql_expr_test": _checks(result), "alert_rule_test": _slow_rank_silent()}
    header = ("# Generated by `python -m tests.whatif_online_cases` from the published what-if "
              "trace ST\n# (tests/fixtures/whatif-ST, robust_metrics/workloads/trace_series.py). "
              "Do not edit.\n# promtool test rules alert_rules/tests/whatif_st_test.yml\n")
    return promtool_file(header, RULE_FILES, [test])


def main() -> int:
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

