"""The alert rules end to end: real Prometheus 2.42, real 4-rank gloo jobs, injected faults.

Ranks serve /metrics in-process (no sidecar), Prometheus scrapes and evaluates every second, and
the rules are the shipped ones rescaled by 1/15 (`robust-metrics rules --time-scale`), the ratio of
these intervals to the production ones (15 s): 5 minute windows become 20 s, `for: 5m` 20 s, the
30 s hang floor 2 s. Two jobs:

- a healthy job that must raise nothing, not even a pending alert; then one of its ranks is
  stopped with SIGSTOP: TrainingHang fires for the run and RankHang names the stopped rank;
- a job with a slow rank and a NaN loss on another: SlowRank names the slow rank and
  NonFiniteLoss the NaN rank.

Detection latencies are printed; bench/rules_detection.py measures them properly.
"""

from __future__ import annotations

import os
import signal
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


def write_test_rules(folder: Path, rank_shards: int = 1) -> Path:
    path = folder / "rules-1s.yml"
    groups = rules.load_groups(time_scale=TIME_SCALE)
    path.write_text(rules.render(rule_shards.shard_by_rank(groups, rank_shards)))
    return path


def alerts(prom: PrometheusServer, run: str, state: str | None = None) -> list[dict[str, Any]]:
    return [a for a in prom.api("alerts")["alerts"]
            if a["labels"].get("run") == run and (state is None or a["state"] == state)]


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
        # SlowRank and the spike baselines need; nothing may even be pending.
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            active = alerts(prom, run)
            assert not active, f"a healthy run raised {active}"
            time.sleep(1)
        assert prom.query(f'run:robust_step_duration_seconds:median5m{{run="{run}"}}'), \
            "the step-time recording rules produced nothing: the silence above proves nothing"

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
