"""Time to name a slow rank and to flag the job's slowdown, and alerts on noise: the rules at the defaults.

    .venv/bin/python bench/straggler_curve.py [--trials 5] [--noise-minutes 60] [--out results.json]

Each trial is a synthetic run of 8 ranks (`--ranks 2,3,8`: of each size in turn;
robust_metrics/workloads/straggler_series.py: a bulk-synchronous step, 0.6 s compute +-10% uniform
jitter per rank and step, 0.4 s transfer, scraped every 15 s); promtool evaluates the shipped rules
(alert_rules/node_summaries.yml, which records the node summaries from the ranks' series as
where no sidecar runs, training.yml, stragglers.yml and attribution.yml, unscaled: 15 s
evaluations, the groups in their files' order) over it, with both SlowRank and
StragglerSlowdownHigh checked at every evaluation.

Slow-rank trials: rank 3 (the last rank of a smaller run) computes `factor` times longer from
minute 5 on (15-minute runs). Time to name = first evaluation at which SlowRank fires naming that
rank, minus the change; time to flag = first evaluation at which StragglerSlowdownHigh fires with
verdict worker, that rank and its node, minus the change. A SlowRank firing for another rank, and a
StragglerSlowdownHigh firing with other labels (another rank, verdict stage or spread) or before
the change, count as false alerts. S, the job's true slowdown, is computed from the scenario's own
counters over the last 5 minutes as the rules define it: median step / (mean compute per step + the
fastest rank's blocked time). Spread trials (runs of 6 ranks or more): ranks 2 and 5 compute 1.25x
longer from minute 5; the expected verdict is spread (no few ranks explain the slowdown); a firing
with another verdict is false, SlowRank naming rank 2 or 5 is reported, not false. Noise trials run
60 minutes of the healthy job and of contention (one rank at a time 1.25x to 2x slower, a different
one every minute from minute 2) and count the alerts of each (an alert with the same labels at
consecutive evaluations counts once); from minute 2 on they also give S as the rules define it
(about 1: every rank is slow as often as the next) and what the contention does cost (the mean step
over that of the same seed without it). Each trial has its own seed.

What this does not measure: a live Prometheus (one scrape and one evaluation of delay more, up to
30 s), real ranks, time-scaled rules (bench/detection_matrix.py runs those on gloo jobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from robust_metrics import rules
from robust_metrics.tables import render_table
from robust_metrics.workloads.straggler_series import (
    SCRAPE_S,
    Scenario,
    promtool_file,
    promtool_series,
    scrapes,
)

RULE_FILES = ("node_summaries.yml", "training.yml", "stragglers.yml", "attribution.yml")
SLOW_RANK, SLOWDOWN = "SlowRank", "StragglerSlowdownHigh"
ALERTS = (SLOW_RANK, SLOWDOWN)
RANK, CHANGE_S, MINUTES = 3, 300.0, 15.0
SPREAD_RANKS, SPREAD_FACTOR = (2, 5), 1.25
FACTORS = (1.05, 1.1, 1.2, 1.3, 2.0)
CONTENTION = (1.25, 1.3, 1.4, 2.0)  # one rank at a time this much slower, a new one each minute
CONTENTION_FROM_S = 120.0
_FIRED = re.compile(rf"alertname: ({'|'.join(ALERTS)}), time: (\S+?),(.*?)"
                    rf"(?=\n\s*alertname: |\Z)", re.S)
_LABELS = re.compile(r"Labels:\{([^}]*)\}")
_PAIR = re.compile(r'(\w+)="([^"]*)"')
_OWN = ("__name__", "alertname", "run", "severity", "action")  # the same on every firing


@dataclass(frozen=True)
class Firing:
    """One alert firing at one evaluation, with the labels that tell firings apart."""

    alert: str
    at: float
    labels: tuple[tuple[str, str], ...]

    def get(self, key: str) -> str | None:
        return dict(self.labels).get(key)

    def text(self) -> str:
        return f"{self.alert}{{{','.join(f'{k}={v}' for k, v in self.labels)}}}"


def firings(scenario: Scenario, run: str = "x") -> list[Firing]:
    """Every evaluation at which SlowRank or StragglerSlowdownHigh fired, with its labels."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool not found (Debian: apt install prometheus)")
    end = int(scenario.minutes * 60 // SCRAPE_S)
    checks = [{"eval_time": rules.format_duration(int(k * SCRAPE_S * 1000)), "alertname": alert,
               "exp_alerts": []} for k in range(1, end + 1) for alert in ALERTS]
    test = {"interval": "15s", "input_series": promtool_series(scenario, run),
            "alert_rule_test": checks}
    spec = promtool_file("", [str(rules.RULES_DIR / f) for f in RULE_FILES], [test])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "curve_test.yml"
        path.write_text(spec)
        result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                                text=True, timeout=600)
    out = []
    for m in _FIRED.finditer(result.stdout + result.stderr):
        at = rules.parse_duration(m.group(2)) / 1000
        for labels in _LABELS.findall(m.group(3)):
            pairs = tuple(sorted((k, v) for k, v in _PAIR.findall(labels) if k not in _OWN))
            out.append(Firing(m.group(1), at, pairs))
    if result.returncode not in (0, 1) or (result.returncode == 1 and not out):
        raise RuntimeError(result.stdout[-3000:] + result.stderr[-3000:])
    return out


def _means(scenario: Scenario, start_s: float, end_s: float) -> tuple[list[float], list[float]]:
    """Each rank's mean compute and mean step time per step between two scrapes."""
    table = scrapes(scenario)
    first, last = table[int(start_s // SCRAPE_S)], table[int(end_s // SCRAPE_S)]
    compute, duration = [], []
    for a, b in zip(first, last, strict=True):
        steps = b.steps - a.steps
        compute.append((b.compute - a.compute) / steps)
        duration.append((b.duration - a.duration) / steps)
    return compute, duration


def true_slowdown(scenario: Scenario, start_s: float, end_s: float) -> float:
    """S of the run between two scrapes, from its counters, as the rules define it: the median
    rank's step time over (the mean compute per step + the least time a rank was blocked)."""
    compute, duration = _means(scenario, start_s, end_s)
    blocked = min(max(d - c, 0.0) for c, d in zip(compute, duration, strict=True))
    return statistics.median(duration) / (statistics.fmean(compute) + blocked)


def step_cost(scenario: Scenario, start_s: float, end_s: float) -> float:
    """The run's mean step time over that of the same run without its slowness."""
    healthy = dataclasses.replace(scenario, slow={}, contention=None)
    return (statistics.fmean(_means(scenario, start_s, end_s)[1])
            / statistics.fmean(_means(healthy, start_s, end_s)[1]))


def _first(times: Iterable[float]) -> float | None:
    after = [t - CHANGE_S for t in times if t >= CHANGE_S]
    return min(after) if after else None


def _false(fired: list[Firing], right: Any) -> list[str]:
    """The distinct firings of StragglerSlowdownHigh that are not `right`, or before the change."""
    return sorted({f.text() for f in fired
                   if f.alert == SLOWDOWN and (f.at < CHANGE_S or not right(f))})


def slow_rank(ranks: int) -> int:
    """The rank made slow in a run of `ranks`: rank 3, or the last of a smaller run."""
    return min(RANK, ranks - 1)


def slow_rank_trial(factor: float, seed: int, ranks: int = 8) -> dict[str, Any]:
    """Rank 3 (or the last) `factor`x slower from minute 5."""
    slow = slow_rank(ranks)
    scenario = Scenario(ranks=ranks, minutes=MINUTES, slow={slow: (factor, CHANGE_S)}, seed=seed)
    fired = firings(scenario)
    named = [f.at for f in fired if f.alert == SLOW_RANK and f.get("rank") == str(slow)]

    def worker(f: Firing) -> bool:
        return (f.get("verdict"), f.get("rank"), f.get("node")) == ("worker", str(slow),
                                                                     f"n{slow}")

    return {"kind": "slow rank", "ranks": ranks, "factor": factor, "seed": seed,
            "S": true_slowdown(scenario, MINUTES * 60 - 300, MINUTES * 60),
            "named_s": _first(named),
            "wrong_ranks": sorted({int(f.get("rank") or -1) for f in fired
                                   if f.alert == SLOW_RANK and f.get("rank") != str(slow)}),
            "flagged_s": _first(f.at for f in fired if f.alert == SLOWDOWN and worker(f)),
            "slowdown_false": _false(fired, worker)}


def spread_trial(seed: int) -> dict[str, Any]:
    """Ranks 2 and 5 1.25x slower from minute 5: no few ranks explain it."""
    scenario = Scenario(ranks=8, minutes=MINUTES, seed=200 + seed,
                        slow={r: (SPREAD_FACTOR, CHANGE_S) for r in SPREAD_RANKS})
    fired = firings(scenario)

    def spread(f: Firing) -> bool:
        return f.get("verdict") == "spread"

    named = {r: _first(f.at for f in fired if f.alert == SLOW_RANK and f.get("rank") == str(r))
             for r in SPREAD_RANKS}
    return {"kind": "spread", "factor": SPREAD_FACTOR, "ranks": list(SPREAD_RANKS), "seed": seed,
            "S": true_slowdown(scenario, MINUTES * 60 - 300, MINUTES * 60),
            "flagged_s": _first(f.at for f in fired if f.alert == SLOWDOWN and spread(f)),
            "slowdown_false": _false(fired, spread),
            "slow_rank_named_s": {str(r): t for r, t in named.items()},
            "wrong_ranks": sorted({int(f.get("rank") or -1) for f in fired
                                   if f.alert == SLOW_RANK
                                   and f.get("rank") not in {str(r) for r in SPREAD_RANKS}})}


def episodes(fired: list[Firing], alert: str) -> int:
    """Distinct alerts: the same labels at consecutive evaluations count once."""
    times: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for f in fired:
        if f.alert == alert:
            times.setdefault(f.labels, []).append(f.at)
    return sum(1 for ts in map(sorted, times.values())
               for before, t in zip([None, *ts], ts, strict=False)
               if before is None or t - before > SCRAPE_S)


def noise_trial(name: str, contention: tuple[float, float, float] | None, seed: int,
                minutes: float, ranks: int = 8) -> dict[str, Any]:
    scenario = Scenario(ranks=ranks, minutes=minutes, contention=contention, seed=100 + seed)
    fired = firings(scenario)
    return {"case": name, "ranks": ranks, "seed": seed, "minutes": minutes,
            "S": true_slowdown(scenario, CONTENTION_FROM_S, minutes * 60),
            "step_cost": step_cost(scenario, CONTENTION_FROM_S, minutes * 60),
            "alerts": {alert: episodes(fired, alert) for alert in ALERTS},
            "slowdown_labels": sorted({f.text() for f in fired if f.alert == SLOWDOWN})}


def _spread(values: list[float], unit: str = " s", digits: int = 0) -> str:
    """Median (range), or '-' for none."""
    if not values:
        return "-"
    median, low, high = statistics.median(values), min(values), max(values)
    if low == high:
        return f"{median:.{digits}f}{unit}"
    return f"{median:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f}{unit})"


def _found(times: list[float | None]) -> tuple[str, str]:
    """'n/N' and the median (range) of those found."""
    found = [t for t in times if t is not None]
    return f"{len(found)}/{len(times)}", _spread(found)


def curve_row(label: str, trials: list[dict[str, Any]], verdict: str) -> list[str]:
    """One row of the slow-rank and spread table."""
    if "named_s" in trials[0]:
        named = _found([t["named_s"] for t in trials])
    else:  # spread: both slow ranks, each trial counted once per rank
        named = _found([t["slow_rank_named_s"][str(r)] for t in trials for r in SPREAD_RANKS])
    flagged = _found([t["flagged_s"] for t in trials])
    false = (f"{sum(bool(t['wrong_ranks']) for t in trials)} / "
             f"{sum(bool(t['slowdown_false']) for t in trials)}")
    return [label, _spread([t["S"] for t in trials], "", 3), *named, verdict, *flagged, false]


CURVE_HEADER = ("case", "S", "SlowRank named", "time to name", "expected verdict", "flagged",
                "time to flag", "trials with false alerts (SlowRank / SSH)")


def noise_row(name: str, trials: list[dict[str, Any]]) -> list[str]:
    """One row of the noise table: alerts in all its trials, and per hour."""
    hours = sum(t["minutes"] for t in trials) / 60
    counts = [sum(t["alerts"][a] for t in trials) for a in ALERTS]
    return [name, _spread([t["S"] for t in trials], "", 3),
            _spread([t["step_cost"] for t in trials], "x", 3), f"{hours:.3g}",
            *(f"{n} ({n / hours:.2f}/h)" for n in counts)]


NOISE_HEADER = ("case", "S (rules)", "step time / healthy", "hours", "SlowRank alerts",
                "SSH alerts")


def _sizes(text: str) -> tuple[int, ...]:
    """`2,3,8`: run sizes of 2 to 1,024 ranks."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rank counts: {text!r}") from None
    if not all(2 <= n <= 1024 for n in sizes):
        raise argparse.ArgumentTypeError(f"rank counts must be 2 to 1024: {text!r}")
    return sizes


def _factors(text: str) -> tuple[float, ...]:
    """`1.1,1.3`: slowdown factors above 1."""
    try:
        factors = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of factors: {text!r}") from None
    if not all(1 < f < 100 for f in factors):
        raise argparse.ArgumentTypeError(f"factors must lie between 1 and 100: {text!r}")
    return factors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="seeds per case (default 5)")
    parser.add_argument("--noise-minutes", type=float, default=60,
                        help="minutes of each noise run (default 60)")
    parser.add_argument("--out", type=Path, help="write every trial as JSON here")
    parser.add_argument("--ranks", type=_sizes, default=(8,), metavar="N[,N...]",
                        help="run sizes, each its own curve and noise cases (default 8; the "
                             "spread case needs 6 ranks or more)")
    parser.add_argument("--factors", type=_factors, default=FACTORS, metavar="F[,F...]",
                        help=f"slow-rank factors (default {','.join(map(str, FACTORS))})")
    args = parser.parse_args()
    results: dict[str, Any] = {"curve": [], "spread": [], "noise": []}
    rows, noise_rows = [], []
    for ranks in args.ranks:
        slow, size = slow_rank(ranks), f"{ranks} ranks: "
        for factor in args.factors:
            trials = [slow_rank_trial(factor, seed, ranks) for seed in range(args.trials)]
            results["curve"] += trials
            rows.append(curve_row(f"{size}rank {slow} {factor:g}x", trials,
                                  f"worker, rank {slow}"))
            print(f"{rows[-1][0]}: done", file=sys.stderr, flush=True)
        if ranks > max(SPREAD_RANKS):
            spread = [spread_trial(seed) for seed in range(args.trials)]
            results["spread"] += spread
            rows.append(curve_row(f"{size}ranks 2, 5 {SPREAD_FACTOR:g}x", spread, "spread"))
        noise = [("healthy", None)] + [(f"contention {f:g}x", (f, 60.0, CONTENTION_FROM_S))
                                       for f in CONTENTION]
        for name, contention in noise:
            trials = [noise_trial(name, contention, seed, args.noise_minutes, ranks)
                      for seed in range(args.trials)]
            results["noise"] += trials
            noise_rows.append(noise_row(size + name, trials))
            print(f"{size}{name}: done", file=sys.stderr, flush=True)
    print(f"\nFrom the change at minute {CHANGE_S / 60:g}, median (range) over the trials that "
          f"found it within {MINUTES - CHANGE_S / 60:g} minutes; SSH = {SLOWDOWN}.")
    print(render_table(CURVE_HEADER, rows))
    print(f"\nNoise, {args.trials} runs of {args.noise_minutes:g} minutes per case:")
    print(render_table(NOISE_HEADER, noise_rows))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
