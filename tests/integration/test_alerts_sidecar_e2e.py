"""Job transitions and faults end to end through the node sidecar, as a cluster runs them.

Four gloo ranks of robust_metrics/workloads/fault_job.py (an MLP with Adam under DDP, one
`watch()` line) write to a multiprocess folder; a real `robust-metrics sidecar` serves it; a real
Prometheus scrapes the sidecar and evaluates the shipped rules every second, rescaled by 1/15 as
in test_alerts_e2e.py.
Each test is one run id in the shared folder:

- checkpoint and eval phases, then a normal end with a slow shutdown: nothing may be active;
- kill -9 of one rank: RankExited names it (and not the peers that die of its death);
- a rank that sleeps before its first step: TrainingHang, and RankHang names it; no loss or
  gradient-norm spike alert when training starts;
- a rank stopped (SIGSTOP) inside the all-reduce its peers wait in: RankHang names it alone;
- a rank 1.3x slower (fixed ratio) and one 1.1x slower (statistical test): SlowRank names it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.alert_checks import (
    WORLD,
    alerts,
    names,
    start_sidecar_job,
    wait_firing,
    wait_steps,
)
from tests.prometheus_fixture import PrometheusServer
from tests.support import RankJob


def unexpected(prom: PrometheusServer, run: str) -> list[dict[str, Any]]:
    """Active alerts of `run`, except a pending ThroughputDrop: phases of 3 s in a 20 s window
    (45 s in 5 minutes at 15 s intervals) do lower the step rate, and its `for: 10m` (40 s here)
    outlasts them; it must never fire."""
    return [a for a in alerts(prom, run)
            if a["state"] == "firing" or a["labels"]["alertname"] != "ThroughputDrop"]


def assert_silent(prom: PrometheusServer, run: str, seconds: float, job: RankJob) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        active = unexpected(prom, run)
        assert not active, f"{run} raised {active}\n{job.logs()}"
        time.sleep(0.5)


def test_phases_and_a_normal_end_raise_nothing(stack: dict[str, Any]) -> None:
    prom, run = stack["prom"], "phases"
    # 150 steps of ~0.05 s; a 3 s checkpoint (45 s at 15 s intervals, over the 2 s hang floor)
    # at step 60, a 3 s evaluation at step 105; then close() and 3 s of shutdown
    args = ["--steps", "150", "--checkpoint-every", "60", "--eval-every", "90",
            "--checkpoint-seconds", "3", "--eval-seconds", "3", "--shutdown-seconds", "3"]
    with start_sidecar_job(stack, run, args) as job:
        wait_steps(prom, run, job, steps=5)
        while any(p.poll() is None for p in job.procs):
            active = unexpected(prom, run)
            assert not active, f"{run} raised {active}\n{job.logs()}"
            time.sleep(0.5)
        assert job.wait(timeout=10) == [0] * WORLD, job.logs()
        assert_silent(prom, run, 4, job)  # exited ranks: the sidecar shows them finished
    finished = prom.query(f'sum(robust_rank_finished{{run="{run}"}})')
    assert finished and float(finished[0]["value"][1]) == WORLD, finished
    phases = prom.query(f'max_over_time(robust_phase{{run="{run}",phase="checkpoint"}}[2m])')
    assert phases and max(float(r["value"][1]) for r in phases) == 1, \
        "the checkpoint phase was never scraped: the silence above proves nothing"


def test_kill_9_of_a_rank_is_named_within_a_scrape_and_an_evaluation(
        stack: dict[str, Any]) -> None:
    prom, run, victim = stack["prom"], "killed", 2
    with start_sidecar_job(stack, run, []) as job:
        wait_steps(prom, run, job)
        os.kill(job.pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        fired = wait_firing(prom, run, "RankExited", 30, job)
        latency = time.monotonic() - t0
        print(f"\nkill -9 of rank {victim}: RankExited after {latency:.1f}s")
        assert fired["labels"]["rank"] == str(victim), fired
        assert fired["labels"]["node"] == "node-a", fired
        assert fired["labels"]["action"] == "restart"
        job.wait(timeout=30)  # the peers fail in their next all-reduce and exit
        time.sleep(3)
        assert names(prom, run, "RankExited") == {str(victim)}, alerts(prom, run)
    assert latency < 6, f"RankExited took {latency:.1f}s (one scrape + one evaluation is 2 s)"


def test_a_rank_that_never_reaches_its_first_step_is_named(stack: dict[str, Any]) -> None:
    prom, run, late = stack["prom"], "late", 1
    with start_sidecar_job(stack, run, ["--first-step-delay-rank", str(late),
                                "--first-step-delay", "12"]) as job:
        t0 = time.monotonic()
        hang = wait_firing(prom, run, "TrainingHang", 30, job)
        rank_hang = wait_firing(prom, run, "RankHang", 20, job)
        print(f"\nrank {late} late: TrainingHang {time.monotonic() - t0:.1f}s after start")
        assert hang["labels"]["action"] == "dump_stacks"
        assert rank_hang["labels"]["rank"] == str(late), rank_hang
        assert rank_hang["labels"]["node"] == "node-a"
        assert names(prom, run, "RankHang") == {str(late)}, alerts(prom, run)
        wait_steps(prom, run, job, steps=40, timeout=60)
        firing = {a["labels"]["alertname"] for a in alerts(prom, run)}
        assert not firing & {"LossSpike", "GradNormSpike", "LossRise", "GradNormRise"}, firing


def test_a_rank_stopped_inside_a_collective_is_named_alone(stack: dict[str, Any]) -> None:
    prom, run, stopped = stack["prom"], "stopped", 3
    with start_sidecar_job(stack, run, ["--stop-rank", str(stopped), "--stop-step", "60"]) as job:
        try:
            rank_hang = wait_firing(prom, run, "RankHang", 60, job)
            wait_firing(prom, run, "TrainingHang", 10, job)
            status = Path(f"/proc/{job.pids[stopped]}/stat").read_text().rsplit(")", 1)[1].split()
            assert status[0] == "T", f"the rank was not stopped: state {status[0]}"
            assert rank_hang["labels"]["rank"] == str(stopped), rank_hang
            assert "process is stopped" in rank_hang["annotations"]["description"]
            time.sleep(2)
            assert names(prom, run, "RankHang") == {str(stopped)}, alerts(prom, run)
        finally:
            os.kill(job.pids[stopped], signal.SIGCONT)


@pytest.mark.parametrize("stall", [3.0, 6.0], ids=["1.5x-threshold", "3x-threshold"])
def test_a_stall_that_ends_by_itself_restarts_nothing(stack: dict[str, Any], stall: float) -> None:
    """A rank stopped for 1.5x and 3x the hang threshold (2 s at this scale), then continued.
    While it is stopped RankHang may name it, and only it. Once it is continued no RankHang
    becomes active, for it or for a healthy rank whose count is a collective behind a peer's
    (the normal skew of a running job), even while the hang record RankHang's group reads is one
    evaluation old. What was scraped before the continue may still raise it for one scrape and
    one evaluation (2 s here); then every RankHang resolves."""
    prom, run, stopped = stack["prom"], f"stall-{stall:g}", 2
    with start_sidecar_job(stack, run, []) as job:
        wait_steps(prom, run, job)
        os.kill(job.pids[stopped], signal.SIGSTOP)
        deadline = time.monotonic() + stall
        try:
            while time.monotonic() < deadline:
                assert names(prom, run, "RankHang") <= {str(stopped)}, alerts(prom, run)
                time.sleep(0.25)
        finally:
            os.kill(job.pids[stopped], signal.SIGCONT)
            continued = time.time()
        steps = prom.query(f'max(robust_global_step{{run="{run}"}})')
        wait_steps(prom, run, job, steps=int(float(steps[0]["value"][1])) + 5, timeout=30)
        while time.time() < continued + 8:
            for a in alerts(prom, run):
                if a["labels"]["alertname"] not in ("RankHang", "RankExited"):
                    continue
                raised = _unix(a["activeAt"])
                assert a["labels"]["alertname"] == "RankHang" and raised < continued + 2, \
                    f"{run}: raised after the stall ended: {a}\n{job.logs()}"
                assert a["labels"]["rank"] == str(stopped), a
                assert time.time() < continued + 4, f"{run}: not resolved after the stall: {a}"
            time.sleep(0.25)


def _unix(rfc3339: str) -> float:
    """Prometheus' activeAt (RFC 3339 with nanoseconds) as a Unix time."""
    from datetime import datetime

    whole, _, fraction = rfc3339.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{fraction or 0}")


@pytest.mark.parametrize("where", ["backward"])
def test_a_1_3x_straggler_is_named_by_its_compute_time(stack: dict[str, Any], where: str) -> None:
    """Under DDP a rank slow in backward delays its peers' bucket all-reduces: their blocked time
    grows, its own does not, so its compute time (step minus blocked) still names it."""
    prom, run, slow = stack["prom"], f"slow-{where}", 1
    with start_sidecar_job(stack, run, ["--compute", "0.1", "--slow-rank", str(slow), "--slow-factor",
                                "1.3", "--slow-where", where]) as job:
        wait_steps(prom, run, job, steps=5)
        t0 = time.monotonic()
        fired = wait_firing(prom, run, "SlowRank", 60, job)
        print(f"\n1.3x {where} straggler: SlowRank {time.monotonic() - t0:.1f}s after 5 steps "
              f"(formula at 1/15 scale: (60 x 0.2 / 0.3 + 45 + 15 + 15) / 15 = 7.7 s)")
        assert fired["labels"]["rank"] == str(slow), fired
        assert float(fired["value"]) > 1.2
        time.sleep(2)
        assert names(prom, run, "SlowRank") == {str(slow)}, alerts(prom, run)


def test_a_1_1x_straggler_is_named_by_the_statistical_test(stack: dict[str, Any]) -> None:
    """A rank 1.1x slower never passes the fixed 1.2 ratio; SlowRank names it by its z against
    the run's step-to-step spread (the real hook's minute windows), held in 75% of
    3 minutes (12 s here): within 5 minutes at the defaults, 20 s at 1/15 scale."""
    prom, run, slow = stack["prom"], "slow-1.1x", 2
    with start_sidecar_job(stack, run, ["--compute", "0.1", "--slow-rank", str(slow), "--slow-factor",
                                "1.1"]) as job:
        wait_steps(prom, run, job, steps=5)
        t0 = time.monotonic()
        fired = wait_firing(prom, run, "SlowRank", 60, job)
        print(f"\n1.1x straggler: SlowRank {time.monotonic() - t0:.1f}s after 5 steps "
              f"(at 1/15 scale: the 10 s start guard, then about 240 s / 15 = 16 s)")
        assert fired["labels"]["rank"] == str(slow), fired
        assert 1.05 < float(fired["value"]) < 1.2, fired  # the statistical branch's ratio
        assert names(prom, run, "SlowRank") == {str(slow)}, alerts(prom, run)
