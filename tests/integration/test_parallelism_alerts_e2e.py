"""SlowRank and RankHang on FSDP2 and on a pipeline, through the real sidecar and Prometheus.

Four gloo ranks of robust_metrics/workloads/parallel_job.py (one `watch()` line) write to a
multiprocess folder; a real `robust-metrics sidecar` serves it; a real Prometheus scrapes it and
evaluates the shipped rules every second, rescaled by 1/15 as in test_alerts_e2e.py. Each test is
one run id:

- FSDP2 over 4 ranks and a 4-stage GPipe pipeline, one rank 1.3x slower: SlowRank names it, and
  no other rank;
- the same stacks with one rank stopped (SIGSTOP) while its peers wait for it: RankHang names it
  alone. On the pipeline the healthy stages enter different numbers of sends and receives (the
  end stages half as many): counted per pair of neighbours, none of them looks behind.

"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from robust_metrics import workloads
from tests.integration.alert_checks import alerts, names, wait_firing, wait_steps
from tests.support import RankJob

WORLD = 4
JOB = Path(workloads.__file__).resolve().parent / "parallel_job.py"
STACKS = {"fsdp2": ["--stack", "fsdp2"], "pipeline": ["--stack", "pp", "--schedule", "gpipe"]}


def start_job(stack: dict[str, Any], run: str, args: list[str]) -> RankJob:
    logs = stack["folder"] / f"logs-{run}"
    logs.mkdir(exist_ok=True)
    return RankJob(WORLD, ["--duration", "120", *args], script=JOB, log_dir=logs, run=run,
                   env={"ROBUST_METRICS_DIR": str(stack["metrics"]),
                        "ROBUST_METRICS_NODE": "node-a"})


@pytest.mark.parametrize("kind", list(STACKS))
def test_slow_rank_names_the_straggler(stack: dict[str, Any], kind: str) -> None:
    prom, run, slow = stack["prom"], f"slow-{kind}", 2
    args = [*STACKS[kind], "--compute", "0.3", "--slow-rank", str(slow), "--slow-factor", "1.3"]
    with start_job(stack, run, args) as job:
        wait_steps(prom, run, job, steps=3)
        t0 = time.monotonic()
        fired = wait_firing(prom, run, "SlowRank", 60, job)
        print(f"\n{kind}: SlowRank {time.monotonic() - t0:.1f}s after 3 steps")
        assert fired["labels"]["rank"] == str(slow), fired
        assert fired["labels"]["node"] == "node-a"
        time.sleep(2)
        # No other rank is named since. (The slowed rank's own alert may have ended: when CPU
        # contention pushes another rank over the ratio in the same 2 minutes, the run's
        # slowness is spread, which names no rank.)
        assert names(prom, run, "SlowRank") <= {str(slow)}, alerts(prom, run)
        assert names(prom, run, "RankHang") == set(), alerts(prom, run)
        job.kill()


@pytest.mark.parametrize("kind", list(STACKS))
def test_rank_hang_names_the_stopped_rank_alone(stack: dict[str, Any], kind: str) -> None:
    prom, run, stopped = stack["prom"], f"stopped-{kind}", 1
    args = [*STACKS[kind], "--compute", "0.05", "--stop-rank", str(stopped), "--stop-step", "40"]
    with start_job(stack, run, args) as job:
        try:
            wait_steps(prom, run, job, steps=5)
            rank_hang = wait_firing(prom, run, "RankHang", 60, job)
            wait_firing(prom, run, "TrainingHang", 10, job)
            status = Path(f"/proc/{job.pids[stopped]}/stat").read_text().rsplit(")", 1)[1].split()
            assert status[0] == "T", f"the rank was not stopped: state {status[0]}"
            assert rank_hang["labels"]["rank"] == str(stopped), rank_hang
            time.sleep(3)
            assert names(prom, run, "RankHang") == {str(stopped)}, alerts(prom, run)
        finally:
            os.kill(job.pids[stopped], signal.SIGCONT)
            job.kill()
