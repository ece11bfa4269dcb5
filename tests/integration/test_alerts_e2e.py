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
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.alert_checks import (
    SHORT_WINDOW,
    STRAGGLER,
    WINDOW,
    WORLD,
    alerts,
    compute_cv,
    slow_rank_and_nan_loss_are_named,
    start_scraped_job,
    unexplained,
    wait_firing,
    wait_steps,
    write_test_rules,
)
from tests.prometheus_fixture import PrometheusServer
from tests.support import free_port_block, require_binary


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


def test_healthy_run_is_silent_then_a_stopped_rank_is_named(setup: dict[str, Any]) -> None:
    prom, run = setup["prom"], "healthy"
    with start_scraped_job(setup, run, []) as job:
        wait_steps(prom, run, job)
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
    slow_rank_and_nan_loss_are_named(setup)


class _Recorded:
    """Alerts and per-rank compute (mean and CV) as a Prometheus would answer them."""

    def __init__(self, active: list[dict[str, Any]], compute: dict[str, float],
                 cv: dict[str, float] | None = None) -> None:
        self.active, self.compute = active, compute
        self.cv = cv if cv is not None else dict.fromkeys(compute, 0.02)

    def api(self, path: str) -> dict[str, Any]:
        return {"alerts": self.active}

    def query(self, expr: str) -> list[dict[str, Any]]:
        if "robust_step_compute_variation_ratio" in expr:
            assert 'window="1m"' in expr and f"[{SHORT_WINDOW}]" in expr, expr
            values = self.cv
        else:
            assert "robust_step_compute_mean_seconds" in expr and f'window="{WINDOW}"' in expr, expr
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
