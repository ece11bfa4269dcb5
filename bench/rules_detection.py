"""Detection latency of the alert rules: time from an injected fault to a firing alert.

    .venv/bin/python bench/rules_detection.py [--interval 1s] [--repeat 1]

A real Prometheus scrapes a real 4-rank gloo job (examples/train_ddp.py, ranks serving /metrics
in-process) and evaluates the shipped rules rescaled to the interval (`--time-scale` =
interval / 15 s), exactly as tests/integration/test_alerts_e2e.py does. Faults and the moment
they happen:

- hang: SIGSTOP of rank 2 (t0 = the signal); TrainingHang and RankHang;
- NaN: rank 1's loss is NaN at step 40 (t0 = the first scrape of rank 1's own endpoint, polled
  at 20 Hz, that shows the non-finite step); NonFiniteLoss;
- slow rank: rank 3 sleeps 0.1 s more per step from the start (t0 = its first step); SlowRank.

At 1 s intervals every window is 1/15 of production, so a latency here times 15 approximates the
latency at the default 15 s intervals for the scaled parts (thresholds, windows, `for`); the
formulas in bench/README.md give the production figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families

from robust_metrics import rules
from robust_metrics.processes import Prometheus, RankJob, free_port_block, wait_for

WORLD = 4


def rank_value(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def _parse_time(text: str) -> float:
    """Unix time of an RFC 3339 timestamp from the Prometheus API (nanoseconds trimmed)."""
    head, _, frac = text.rstrip("Z").partition(".")
    stamp = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC).timestamp()
    return stamp + (float("0." + frac[:6]) if frac else 0.0)


def firing_at(prom: Prometheus, run: str, alertname: str, timeout: float,
              hold: dict[str, float]) -> float:
    """Unix time at which `alertname` fired for `run`: its activeAt plus its `for`."""
    def firing() -> float | None:
        for alert in prom.api("alerts")["alerts"]:
            if (alert["labels"].get("run") == run and alert["state"] == "firing"
                    and alert["labels"]["alertname"] == alertname):
                return _parse_time(alert["activeAt"]) + hold.get(alertname, 0.0)
        return None
    return wait_for(firing, timeout=timeout, interval=0.2, message=f"{alertname} for {run}")


def one_round(prom: Prometheus, base: int, tag: str, logs: Path, interval_s: float,
              hold: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    common = ["--steps", "1000000", "--step-sleep", "0.05"]
    timeout = 200 * interval_s + 60
    # slow rank and NaN in one job
    run = f"faults-{tag}"
    with RankJob(WORLD, [*common, "--slow-rank", "3", "--slow-seconds", "0.1", "--nan-rank", "1",
                         "--nan-step", "40"],
                 env={"ROBUST_METRICS_PORT": str(base)}, log_dir=logs, run=run):
        t_slow = wait_for(lambda: rank_value(base + 3, "robust_steps_total") >= 1 and
                            time.time(), timeout=120, interval=0.05, message="first step")
        t_nan = wait_for(lambda: rank_value(base + 1, "robust_nonfinite_loss_steps_total") >= 1
                           and time.time(), timeout=120, interval=0.05, message="NaN step")
        out["NonFiniteLoss"] = firing_at(prom, run, "NonFiniteLoss", timeout, hold) - t_nan
        out["SlowRank"] = firing_at(prom, run, "SlowRank", timeout, hold) - t_slow
    # hang of a stopped rank
    run = f"hang-{tag}"
    with RankJob(WORLD, common, env={"ROBUST_METRICS_PORT": str(base)}, log_dir=logs,
                 run=run) as job:
        wait_for(lambda: rank_value(base + 2, "robust_steps_total") >= 20, timeout=120,
                   interval=0.2, message="20 steps")
        time.sleep(25 * interval_s)  # let the step-time medians settle
        os.kill(job.pids[2], signal.SIGSTOP)
        t0 = time.time()
        try:
            out["TrainingHang"] = firing_at(prom, run, "TrainingHang", timeout, hold) - t0
            out["RankHang"] = firing_at(prom, run, "RankHang", timeout, hold) - t0
        finally:
            os.kill(job.pids[2], signal.SIGCONT)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", default="1s", help="scrape and evaluation interval")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    interval_s = rules.parse_duration(args.interval) / 1000
    scale = interval_s / 15
    os.environ["ROBUST_METRICS_TIME_SCALE"] = repr(scale)  # the ranks' windows, as the rules'
    base = free_port_block(WORLD)
    with tempfile.TemporaryDirectory() as tmp:
        rule_file = Path(tmp) / "rules.yml"
        groups = rules.load_groups(time_scale=scale)
        hold = {a["alert"]: rules.parse_duration(a["for"]) / 1000
                for a in rules.alerts(groups) if "for" in a}
        rule_file.write_text(rules.render(groups))
        targets = [f"127.0.0.1:{base + r}" for r in range(WORLD)]
        with Prometheus(Path(tmp) / "prom", targets, rule_files=[rule_file],
                        scrape_interval=args.interval,
                        evaluation_interval=args.interval) as prom:
            rounds = []
            for i in range(args.repeat):
                logs = Path(tmp) / f"logs{i}"
                logs.mkdir()
                rounds.append(one_round(prom, base, str(i), logs, interval_s, hold))
                print(json.dumps(rounds[-1]), flush=True)
    summary = {name: {"median_s": round(statistics.median(r[name] for r in rounds), 2),
                      "max_s": round(max(r[name] for r in rounds), 2),
                      "x15_s": round(15 * statistics.median(r[name] for r in rounds), 1)}
               for name in rounds[0]}
    print(json.dumps({"interval": args.interval, "time_scale": scale, "rounds": len(rounds),
                      "latency": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
