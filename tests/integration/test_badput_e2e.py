"""Badput from what the job did, on real parts: three 2-rank gloo jobs of
robust_metrics/workloads/fault_job.py at once, with steps of 0.05 s, 0.5 s and 5 s (shorter and
longer than the 1 s scrape interval), each with one data stall that ends by itself, then a
normal end. The real sidecar serves their folder; a real Prometheus scrapes it every second and
evaluates the shipped rules every second, time-scaled by 1/15 (tests/integration/conftest.py).

For each job, as of its last step (the hook's own timestamp):
- the causes add up to its wall time (from the evaluation that first saw it) within one
  evaluation interval;
- hang is the stall beyond the job's own step time (the stalled step took the stall plus one step
  time) within one scrape interval plus one evaluation, and nothing else is hang;
- the productive share equals the ETTR estimate (unique steps x median step time) within 2 points
  plus the breakdown's resolution (each evaluation gives its whole interval to one cause: one
  evaluation is 2 points of a 50 s job, nothing of a day-long one) plus as much as the median
  step time moved over the run (the estimate's own error where the load on the machine changes);
and nothing accrues once the sidecar has seen its ranks end normally.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from robust_metrics.workloads import FAULT_JOB
from tests.prometheus_fixture import PrometheusServer
from tests.support import RankJob, wait_until

WORLD = 2
SCRAPE_S = EVAL_S = 1.0


@dataclass(frozen=True)
class Case:
    step_s: float
    stall_step: int
    stall_s: float
    steps: int  # in all: about a minute, the stall then at least 20 s of steady steps (5 min at 15 s)

    @property
    def run(self) -> str:
        return f"badput-{self.step_s:g}s"


CASES = (Case(0.05, 60, 3.0, 900), Case(0.5, 8, 4.0, 100), Case(5.0, 3, 13.0, 11))


def _value(prom: PrometheusServer, expr: str, at: float) -> float | None:
    result = prom.query(expr, at=at)
    return float(result[0]["value"][1]) if result else None


def _causes(prom: PrometheusServer, run: str, at: float) -> dict[str, float]:
    result = prom.query(f'run:robust_badput_seconds:total{{run="{run}"}}', at=at)
    return {r["metric"]["cause"]: float(r["value"][1]) for r in result}


def test_badput_adds_up_and_counts_only_the_stall_as_hang(stack: dict[str, Any]) -> None:
    prom = stack["prom"]
    jobs = {}
    try:
        for case in CASES:
            logs = stack["folder"] / f"logs-{case.run}"
            logs.mkdir(exist_ok=True)
            jobs[case] = RankJob(
                WORLD, ["--steps", str(case.steps), "--compute", str(case.step_s),
                        "--stall-step", str(case.stall_step),
                        "--stall-seconds", str(case.stall_s)],
                script=FAULT_JOB, log_dir=logs, run=case.run,
                env={"ROBUST_METRICS_DIR": str(stack["metrics"]),
                     "ROBUST_METRICS_NODE": "node-a"})
        for job in jobs.values():
            codes = job.wait(timeout=240)
            assert codes == [0] * WORLD, job.logs()
        failures = []
        for case in jobs:
            try:
                _check(prom, case)
            except AssertionError as exc:
                failures.append(str(exc))
        assert not failures, "\n".join(failures)
    finally:
        for job in jobs.values():
            job.kill()


def _timeline(prom: PrometheusServer, case: Case, at: float) -> list[str]:
    """The cause at each evaluation from shortly before `at` on, for a failure's message."""
    rows = prom.query_range(f'run:robust_badput_cause:current{{run="{case.run}"}}',
                            at - 3, time.time(), EVAL_S)
    return sorted(f"{float(t) - at:+.1f}s {r['metric']['cause']}" for r in rows
                  for t, _ in r["values"])


def _check(prom: PrometheusServer, case: Case) -> None:
    sel = f'{{run="{case.run}"}}'
    # the sidecar sees the ranks end; then the breakdown must hold still
    wait_until(lambda: _value(prom, f"run:robust_badput_ended:bool{sel}", time.time()) == 1,
               timeout=30, interval=0.5, message=f"{case.run}: the end to be seen")
    ended_seen = time.time()
    last_step = _value(prom, f"max(max_over_time(robust_last_step_timestamp_seconds{sel}[1m]))",
                       time.time())
    assert last_step is not None
    at = last_step  # what the rules knew at the job's last step
    causes = _causes(prom, case.run, at)
    start = _value(prom, f"run:robust_run_start_timestamp_seconds:min{sel}", at)
    median = _value(prom, f"run:robust_step_duration_seconds:median_held{sel}", at)
    ettr = _value(prom, f"run:robust_ettr:ratio_since_start{sel}", at)
    productive = _value(prom, f"run:robust_ettr:ratio_productive{sel}", at)
    assert None not in (start, median, ettr, productive), (causes, start, median, ettr)
    # the evaluation that wrote the totals the query at `at` returns (a loaded Prometheus may
    # skip one): the wall time to it
    evaluated = _value(prom, f"timestamp(run:robust_badput_seconds:wall{sel})", at)
    assert evaluated is not None and at - evaluated < 3 * EVAL_S, (at, evaluated)
    wall = evaluated - start
    stall = case.stall_s  # no step for the stall and one step time, which is the step's own
    # The estimate counts every step at the last window's median step time: it is off by as
    # much as that median moved over the run (a machine whose load changes moves it).
    medians = [_value(prom, f"{fn}_over_time(run:robust_step_duration_seconds:median_held{sel}"
                            f"[{wall:.0f}s])", at) for fn in ("min", "max")]
    assert None not in medians, medians
    unsteady = (medians[1] - medians[0]) / medians[0]
    report = (f"{case.run}: {', '.join(f'{c} {v:.2f}s' for c, v in sorted(causes.items()))}; "
              f"wall {wall:.2f}s, median step {median:.3f}s, expected hang {stall:.2f}s, "
              f"ETTR {ettr:.3f}, productive share {productive:.3f}, median step moved "
              f"{unsteady:.1%} over the run")
    print(report)
    assert sum(causes.values()) == pytest.approx(wall, abs=EVAL_S), report
    assert causes.get("hang", 0) == pytest.approx(stall, abs=SCRAPE_S + EVAL_S), report
    assert causes.get("restart", 0) == causes.get("recomputed", 0) == 0, report
    assert productive == pytest.approx(ettr, abs=0.02 + EVAL_S / wall + unsteady), report
    # after the end: nothing more accrues (at most the evaluation in flight when the end was
    # seen). Between the last step and the end the ranks tear down, which on a loaded machine
    # takes seconds of real wall time, accounted as such.
    at_end = sum(_causes(prom, case.run, ended_seen).values())
    after = sum(_causes(prom, case.run, time.time()).values())
    assert after - at_end < 2 * EVAL_S, (after, at_end, report, _timeline(prom, case, at))
    time.sleep(2 * EVAL_S)
    assert sum(_causes(prom, case.run, time.time()).values()) == after, report
