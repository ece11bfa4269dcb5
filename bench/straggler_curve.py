"""Time to name a slow rank against its slowdown, and alerts on noise: the rules at the defaults.

    .venv/bin/python bench/straggler_curve.py [--trials 5] [--out results.json]

Each trial is a synthetic 8-rank run (robust_metrics/workloads/straggler_series.py: a
bulk-synchronous step, 0.6 s compute +-10% uniform jitter per rank and step, 0.4 s transfer,
scraped every 15 s) in which rank 3 computes `factor` times longer from minute 5 on; promtool
evaluates the shipped rules (alert_rules/training.yml and stragglers.yml, unscaled: 15 s
evaluations) over it, with SlowRank checked at every evaluation. Time to name = first evaluation
at which SlowRank fires naming rank 3, minus the change; a firing for any other rank counts as a
false alert. Each trial has its own seed. The noise trials run 60 minutes of the healthy job and of
contention (one rank at a time 1.25x to 2x slower, a different one every minute from minute 2)
and count the alerts.

What this does not measure: a live Prometheus (one scrape and one evaluation of delay more, up to
30 s), real ranks, time-scaled rules (bench/detection_matrix.py runs those on gloo jobs).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from robust_metrics import rules
from robust_metrics.workloads.straggler_series import (
    SCRAPE_S,
    Scenario,
    promtool_series,
)

RULE_FILES = ("training.yml", "stragglers.yml")
SLOW_RANK, CHANGE_S = 3, 300.0
FACTORS = (1.05, 1.1, 1.2, 1.3, 2.0)
CONTENTION = (1.25, 1.3, 1.4, 2.0)  # one rank at a time this much slower, a new one each minute
_FIRED = re.compile(r"alertname: SlowRank, time: (\S+?),(.*?)(?=\n    alertname: |\Z)", re.S)
_RANK = re.compile(r'Labels:\{[^}]*\brank="(\d+)"')


def _group_order() -> list[str]:
    return [g["name"] for f in RULE_FILES
            for g in yaml.safe_load((rules.RULES_DIR / f).read_text())["groups"]]


def firings(scenario: Scenario, run: str = "x") -> dict[int, list[float]]:
    """Seconds of every evaluation at which SlowRank fired, by the rank it named."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise SystemExit("promtool not found (Debian: apt install prometheus)")
    end = int(scenario.minutes * 60 // SCRAPE_S)
    spec = {
        "rule_files": [str(rules.RULES_DIR / f) for f in RULE_FILES],
        "evaluation_interval": "15s",
        "group_eval_order": _group_order(),
        "tests": [{
            "interval": "15s",
            "input_series": promtool_series(scenario, run),
            "alert_rule_test": [{"eval_time": rules.format_duration(int(k * SCRAPE_S * 1000)),
                                 "alertname": "SlowRank", "exp_alerts": []}
                                for k in range(1, end + 1)],
        }],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "curve_test.yml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                                text=True, timeout=600)
    out: dict[int, list[float]] = {}
    for m in _FIRED.finditer(result.stdout + result.stderr):
        at = rules.parse_duration(m.group(1)) / 1000
        for rank in _RANK.findall(m.group(2)):
            out.setdefault(int(rank), []).append(at)
    if result.returncode not in (0, 1) or (result.returncode == 1 and not out):
        raise RuntimeError(result.stdout[-3000:] + result.stderr[-3000:])
    return out


def time_to_name(factor: float, seed: int, minutes: float = 15) -> dict[str, Any]:
    """One trial: rank 3 `factor`x slower from minute 5."""
    fired = firings(Scenario(ranks=8, minutes=minutes, slow={SLOW_RANK: (factor, CHANGE_S)},
                             seed=seed))
    named = [t for t in fired.get(SLOW_RANK, []) if t >= CHANGE_S]
    wrong = sorted({r for r in fired if r != SLOW_RANK})
    return {"factor": factor, "seed": seed,
            "seconds": min(named) - CHANGE_S if named else None, "wrong_ranks": wrong}


def noise_alerts(scenario: Scenario) -> int:
    """Distinct alert episodes (a rank firing at consecutive evaluations counts once)."""
    episodes = 0
    for times in firings(scenario).values():
        episodes += sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] > SCRAPE_S)
    return episodes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--noise-minutes", type=float, default=60)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {"curve": [], "noise": []}
    for factor in FACTORS:
        trials = [time_to_name(factor, seed) for seed in range(args.trials)]
        results["curve"] += trials
        named = [t["seconds"] for t in trials if t["seconds"] is not None]
        wrong = sum(bool(t["wrong_ranks"]) for t in trials)
        median = f"{statistics.median(named):.0f} s" if named else "-"
        span = f"{min(named):.0f}-{max(named):.0f} s" if named else "-"
        print(f"{factor:>5}x: named in {len(named)}/{len(trials)} trials within 10 min, "
              f"median {median}, range {span}; other ranks named in {wrong} trials", flush=True)
    noise = [("healthy", None)] + [(f"contention {f:g}x", (f, 60.0, 120.0))
                                   for f in CONTENTION]
    for name, contention in noise:
        for seed in range(args.trials):
            scenario = Scenario(ranks=8, minutes=args.noise_minutes, contention=contention,
                                seed=100 + seed)
            alerts = noise_alerts(scenario)
            results["noise"].append({"case": name, "seed": seed, "alerts": alerts,
                                     "minutes": args.noise_minutes})
        total = sum(n["alerts"] for n in results["noise"] if n["case"] == name)
        hours = args.trials * args.noise_minutes / 60
        print(f"{name}: {total} SlowRank alerts in {hours:.0f} h", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
