"""The alert rules end to end: real Prometheus 2.42, real 4-rank gloo jobs, injected faults.

Ranks serve /metrics in-process (no sidecar), Prometheus scrapes and evaluates every second, and
the rules are the shipped ones rescaled by 1/15 (`robust-metrics rules --time-scale`), the ratio of
these intervals to the production ones (15 s): 5 minute windows become 20 s, `for: 5m` 20 s, the
30 s hang floor 2 s. Two jobs:

- a healthy job that must raise nothing; then one of its ranks is stopped with SIGSTOP:
  TrainingHang fires for the run and RankHang names the stopped rank. "Nothing" holds on a busy
  machine too, without assuming spare cores: no alert fires (a pending one neither acts nor
  notifies; its hold is what tells the CI machine's passing contention from a straggler), and
  the informational straggler estimate (action none), pending or firing, must say what the raw
  compute samples show: a rank really slower than the median, or spread that the ranks'
  step-to-step variation explains. Any alert that fires, and an unexplained straggler
  estimate, fail the test;
- a job with a slow rank and a NaN loss on another: SlowRank names the slow rank and
  NonFiniteLoss the NaN rank.

Detection latencies are printed; bench/rules_detection.py measures them properly.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from robust_metrics import rule_shards, rules
from tests.prometheus_fixture import PrometheusServer
from tests.support import RankJob, free_port_block, require_binary, wait_until

pytestmark = pytest.mark.integration
WORLD = 4
TIME_SCALE = 1 / 15  # 1 s intervals here, 15 s in production
STEP_SLEEP = "0.05"
WINDOW = f"{300 * TIME_SCALE:g}s"  # the rules' 5-minute window at this time scale
SHORT_WINDOW = f"{120 * TIME_SCALE:g}s"  # StragglerSlowdownHigh's 2-minute window
MAX_OF_4_NORMALS = 1.03  # the mean of the largest of 4 standard normal draws (1.0294)
STRAGGLER = "StragglerSlowdownHigh"


def write_test_rules(folder: Path, rank_shards: int = 1) -> Path:
    path = folder / "rules-1s.yml"
    groups = rules.load_groups(time_scale=TIME_SCALE)
    path.write_text(rules.render(rule_shards.shard_by_rank(groups, rank_shards)))
    return path


def alerts(prom: PrometheusServer, run: str, state: str | None = None) -> list[dict[str, Any]]:
    return [a for a in prom.api("alerts")["alerts"]
            if a["labels"].get("run") == run and (state is None or a["state"] == state)]


def unexplained(prom: PrometheusServer, run: str) -> list[str]:
    """What a healthy run must not show, each with the reason: an alert that fires (it acts or
    notifies), and the straggler estimate, pending or firing, where the raw samples do not
    explain it (`straggler_unexplained`; explained, it has no action and may fire).

    A pending alert neither acts nor notifies: its hold is how a rule tells a passing
    disturbance from a lasting one. Under the suite's load a rank can compute 1.25x its peers
    for a minute of rule time (4 s here): SlowRank is then pending until the contention moves
    on, which is what the rule promises. Pending alerts are printed.
    """
    problems = []
    for a in alerts(prom, run):
        name, action, state = a["labels"]["alertname"], a["labels"].get("action"), a["state"]
        if name == STRAGGLER and action == "none":
            why = straggler_unexplained(prom, run, a)
            if why:
                problems.append(why)
        elif state == "firing":
            problems.append(f"{name} firing, action {action}: {a}")
        else:
            print(f"\n{run}: {name} pending, action {action}, value {a['value']} (held, not "
                  f"acted on): {a['labels']}")
    return problems


def straggler_unexplained(prom: PrometheusServer, run: str, alert: dict[str, Any]) -> str | None:
    """None when StragglerSlowdownHigh (pending or firing, action none) says what the raw
    compute samples show (sums, squares and counts, no recorded series); the reason otherwise
    (a DDP job has no pipeline stage to blame). Another process competing for the two cores
    really slows one rank or another, and the estimate may say so:

    - verdict worker: the named rank computes at least 5% more per step than the median rank
      over the verdict's 5-minute window;
    - verdict spread: either some rank does (contention that stayed), or the ranks'
      step-to-step variation over the estimate's 2-minute window is large enough to make it.
      S - 1 is the slowest rank's mean compute above the mean rank's, over the ideal step; a
      burst that stalls one rank and then another raises that rank's mean by about its own
      standard deviation at most, so over 4 ranks S - 1 <= E[max of 4 standard normals] x
      CV = 1.03 x the largest coefficient of variation of a rank's compute. A rank that is
      slower at every step has a small CV and is not explained by it.

    One slow rank needs 1.14x the others' compute for S = 1.1 with four ranks; equal ranks stay
    under 1.01x on this machine even with both cores saturated (/proc/pressure/cpu at 80%),
    their CV under 0.13 with the rest of the suite running beside them.
    """
    labels = alert["labels"]
    verdict, rank = labels.get("verdict"), labels.get("rank")
    if verdict not in {"worker", "spread"} or (verdict == "worker" and rank is None):
        return f"{STRAGGLER} {alert['state']} with a cause a DDP job cannot have: {alert}"
    compute = _by_rank(prom, f"rate(robust_step_compute_seconds_sum{{run=\"{run}\"}}[{WINDOW}])"
                             f" / rate(robust_step_compute_seconds_count{{run=\"{run}\"}}"
                             f"[{WINDOW}])")
    if not compute:
        return f"{STRAGGLER} {alert['state']} and no compute samples to check it against: {alert}"
    median = statistics.median(compute.values())
    slowest = max(compute, key=compute.__getitem__)
    named = rank if verdict == "worker" else slowest
    ratio = compute.get(str(named), 0.0) / median
    slowdown = float(alert["value"])
    said = (f"{run}: {STRAGGLER} {alert['state']} at S = {slowdown:.3f}, verdict {verdict}, "
            f"rank {named} computing {ratio:.3f}x the median rank")
    if ratio >= 1.05:
        print(f"\n{said} (the machine's other work)")
        return None
    if verdict == "spread":
        cv = compute_cv(prom, run)
        largest = max(cv.values(), default=0.0)
        if slowdown - 1 <= MAX_OF_4_NORMALS * largest:
            print(f"\n{said}, compute CV up to {largest:.3f}: spread by bursts (the machine's "
                  "other work)")
            return None
        return (f"{said}, and S - 1 above 1.03 x the largest compute CV ({largest:.3f}) over "
                f"{SHORT_WINDOW}: neither a slower rank nor bursts explain it. CV by rank: {cv}; "
                f"compute (s/step): {compute}")
    return (f"{said}: no straggler explains it. Per-rank compute (s/step): {compute}")


def compute_cv(prom: PrometheusServer, run: str) -> dict[str, float]:
    """Each rank's coefficient of variation of compute per step over StragglerSlowdownHigh's
    2-minute window, from the raw sums of compute, of its squares, and the step counts:
    CV^2 = E[c^2] / E[c]^2 - 1."""
    sel, window = f'{{run="{run}"}}', f"[{SHORT_WINDOW}]"
    return _by_rank(prom, f"sqrt(clamp_min("
                          f"rate(robust_step_compute_seconds_squared_total{sel}{window})"
                          f" * rate(robust_step_compute_seconds_count{sel}{window})"
                          f" / rate(robust_step_compute_seconds_sum{sel}{window}) ^ 2 - 1, 0))")


def _by_rank(prom: PrometheusServer, expr: str) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(expr)}


def wait_firing(prom: PrometheusServer, run: str, alertname: str, timeout: float,
                job: RankJob) -> dict[str, Any]:
    def firing() -> dict[str, Any] | None:
        for a in alerts(prom, run, "firing"):
            if a["labels"]["alertname"] == alertname:
                return a
        return None

    try:
        return wait_until(firing, timeout=timeout, interval=0.5, message=f"{alertname} firing")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nactive alerts: {alerts(prom, run)}\n{job.logs()}") from None


@pytest.fixture(scope="module", params=[1, 2], ids=["one-group", "rank-shards-2"])
def setup(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A Prometheus with the rules as one group per concern, and split by rank in two shards
    (`rules --rank-shards 2`: ranks 0 and 2 in one group, 1 and 3 in the other, evaluated at
    their own moments): the same faults must be named, and nothing may fire while healthy."""
    require_binary("prometheus")
    folder = tmp_path_factory.mktemp("e2e")
    ports = {"healthy": free_port_block(WORLD), "faulty": free_port_block(WORLD)}
    targets = [f"127.0.0.1:{base + r}" for base in ports.values() for r in range(WORLD)]
    server = PrometheusServer(folder / "prometheus", targets,
                              rule_files=[write_test_rules(folder, request.param)])
    server.start()
    try:
        yield {"prom": server, "ports": ports, "folder": folder}
    finally:
        server.stop()


def start_job(setup: dict[str, Any], run: str, args: list[str]) -> RankJob:
    logs = setup["folder"] / f"logs-{run}"
    logs.mkdir(exist_ok=True)
    return RankJob(WORLD, ["--steps", "1000000", "--step-sleep", STEP_SLEEP, *args],
                   env={"ROBUST_METRICS_PORT": str(setup["ports"][run])}, log_dir=logs, run=run)


def wait_stepping(prom: PrometheusServer, run: str, job: RankJob, timeout: float = 90) -> None:
    def stepping() -> bool:
        result = prom.query(f'count(robust_steps_total{{run="{run}"}} > 20)')
        return bool(result) and float(result[0]["value"][1]) == WORLD
    try:
        wait_until(stepping, timeout=timeout, interval=0.5, message=f"{run}: 4 ranks stepping")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{job.logs()}") from None


def test_healthy_run_is_silent_then_a_stopped_rank_is_named(setup: dict[str, Any]) -> None:
    prom, run = setup["prom"], "healthy"
    with start_job(setup, run, []) as job:
        wait_stepping(prom, run, job)
        # 25 s at 1/15 scale: over six minutes of production time, longer than every window
        # SlowRank and the spike baselines need; nothing may even be pending (`unexplained`).
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            problems = unexplained(prom, run)
            assert not problems, "a healthy run raised:\n" + "\n".join(problems)
            time.sleep(1)
        assert prom.query(f'run:robust_step_duration_seconds:median5m{{run="{run}"}}'), \
            "the step-time recording rules produced nothing: the silence above proves nothing"
        cv = compute_cv(prom, run)
        assert len(cv) == WORLD and all(0 <= v < 1 for v in cv.values()), \
            f"the straggler estimate's explanation cannot read the ranks' compute CV: {cv}"

        stopped = 2
        os.kill(job.pids[stopped], signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            hang = wait_firing(prom, run, "TrainingHang", 60, job)
            t_hang = time.monotonic() - t0
            rank_hang = wait_firing(prom, run, "RankHang", 30, job)
            t_rank = time.monotonic() - t0
        finally:
            os.kill(job.pids[stopped], signal.SIGCONT)
        print(f"\nSIGSTOP rank {stopped}: TrainingHang after {t_hang:.1f}s, "
              f"RankHang after {t_rank:.1f}s")
        assert hang["labels"]["action"] == "dump_stacks"
        assert hang["labels"]["severity"] == "critical"
        assert rank_hang["labels"]["rank"] == str(stopped), rank_hang
        assert rank_hang["labels"]["node"], rank_hang
        assert rank_hang["labels"]["action"] == "restart"
        assert f"rank {stopped} on node" in rank_hang["annotations"]["description"]
        others = {a["labels"].get("rank") for a in alerts(prom, run)
                  if a["labels"]["alertname"] == "RankHang"}
        assert others == {str(stopped)}, others


def test_slow_rank_and_nan_loss_are_named(setup: dict[str, Any]) -> None:
    prom, run = setup["prom"], "faulty"
    slow, nan = 3, 1
    with start_job(setup, run, ["--slow-rank", str(slow), "--slow-seconds", "0.1",
                                "--nan-rank", str(nan), "--nan-step", "60"]) as job:
        t0 = time.monotonic()
        nonfinite = wait_firing(prom, run, "NonFiniteLoss", 120, job)
        print(f"\nNonFiniteLoss after {time.monotonic() - t0:.1f}s from job start")
        assert nonfinite["labels"]["rank"] == str(nan), nonfinite
        assert {a["labels"].get("rank") for a in alerts(prom, run)
                if a["labels"]["alertname"] == "NonFiniteLoss"} == {str(nan)}
        slow_alert = wait_firing(prom, run, "SlowRank", 120, job)
        print(f"SlowRank after {time.monotonic() - t0:.1f}s from job start")
        assert slow_alert["labels"]["rank"] == str(slow), slow_alert
        assert slow_alert["labels"]["action"] == "checkpoint"
        assert float(slow_alert["value"]) > 1.25
        slow_ranks = {a["labels"].get("rank") for a in alerts(prom, run)
                      if a["labels"]["alertname"] == "SlowRank"}
        assert slow_ranks == {str(slow)}, slow_ranks
        hangs = [a for a in alerts(prom, run) if "Hang" in a["labels"]["alertname"]]
        assert not hangs, f"a slow rank is not a hang: {hangs}"


class _Recorded:
    """Alerts and per-rank compute (mean and CV) as a Prometheus would answer them."""

    def __init__(self, active: list[dict[str, Any]], compute: dict[str, float],
                 cv: dict[str, float] | None = None) -> None:
        self.active, self.compute = active, compute
        self.cv = cv if cv is not None else dict.fromkeys(compute, 0.02)

    def api(self, path: str) -> dict[str, Any]:
        return {"alerts": self.active}

    def query(self, expr: str) -> list[dict[str, Any]]:
        if "squared" in expr:
            assert f"[{SHORT_WINDOW}]" in expr, expr
            values = self.cv
        else:
            assert "robust_step_compute_seconds_sum" in expr and f"[{WINDOW}]" in expr, expr
            values = self.compute
        return [{"metric": {"rank": r}, "value": [0, str(v)]} for r, v in values.items()]


def _alert(name: str, action: str, state: str = "pending", **labels: str) -> dict[str, Any]:
    return {"labels": {"alertname": name, "action": action, "run": "healthy", **labels},
            "state": state, "value": "1.31e+00", "annotations": {}}


def test_a_healthy_run_may_show_only_a_straggler_its_samples_explain() -> None:
    rank1_slow = {"0": 0.052, "1": 0.065, "2": 0.052, "3": 0.053}
    equal = {"0": 0.052, "1": 0.053, "2": 0.052, "3": 0.053}
    worker1 = {"verdict": "worker", "rank": "1", "node": "n1"}
    spread = {"verdict": "spread"}

    def problems(active: list[dict[str, Any]], compute: dict[str, float],
                 cv: dict[str, float] | None = None) -> list[str]:
        return unexplained(_Recorded(active, compute, cv), "healthy")  # type: ignore[arg-type]

    assert problems([], equal) == []
    assert problems([_alert(STRAGGLER, "none", **worker1)], rank1_slow) == []
    assert problems([_alert(STRAGGLER, "none", "firing", **worker1)], rank1_slow) == []
    assert problems([_alert(STRAGGLER, "none", **spread)], rank1_slow) == []
    assert problems([_alert(STRAGGLER, "none", **worker1)], equal)  # samples say no
    assert problems([_alert(STRAGGLER, "none", **spread)], equal)  # steady ranks: CV 0.02
    # bursts: one rank's compute varies by 31% step to step, so S = 1.31 is within 1.03 x CV
    assert problems([_alert(STRAGGLER, "none", **spread)], equal, {**equal, "2": 0.31}) == []
    assert problems([_alert(STRAGGLER, "none", "firing", **spread)], equal, {"2": 0.31}) == []
    assert problems([_alert(STRAGGLER, "none", **spread)], equal, {"2": 0.29})
    assert problems([_alert(STRAGGLER, "none", **worker1)], equal, {"1": 0.5})  # names a rank
    assert problems([_alert(STRAGGLER, "none", verdict="worker", rank="2")], rank1_slow)
    assert problems([_alert(STRAGGLER, "none", verdict="worker")], rank1_slow)
    assert problems([_alert(STRAGGLER, "none", verdict="stage", pp_rank="1")], rank1_slow)
    # an action held (pending) is not taken; one that fires is, whatever the samples say
    assert problems([_alert("SlowRank", "checkpoint", **worker1)], equal) == []
    assert problems([_alert("SlowRank", "checkpoint", "firing", **worker1)], rank1_slow)
    assert problems([_alert("LossSpike", "none", "firing")], rank1_slow)
