"""The `slurm` adapter against a real single-node Slurm (munge, slurmctld, slurmd, slurmrestd).

A batch job runs examples/train_ddp.py with the hook: the adapter's SIGUSR1 makes it checkpoint
once, requeue restarts it and it resumes from that checkpoint, drain marks the node drained.
The REST error paths are checked too (what needs no Slurm: tests/test_slurm_adapter.py). Skips
(with the reason) only where the Debian packages are not installed or the test is not root.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from bench.slurm_cluster import SlurmCluster
from robust_metrics.bridge.schedulers import base
from robust_metrics.bridge.schedulers.slurm import SlurmScheduler
from tests.slurm.fixture import job_log, job_report, slurm_cluster
from tests.support import EXAMPLE, ROOT, free_port_block, wait_until

__all__ = ["slurm_cluster"]  # the module fixture, imported for pytest

SBATCH = ROOT / "tests" / "slurm" / "train.sbatch"


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    return slurm_cluster


@pytest.fixture
def rest(cluster: SlurmCluster, tmp_path: Path) -> SlurmScheduler:
    token = tmp_path / "jwt"
    token.write_text(f"SLURM_JWT={cluster.token()}\n")  # as `scontrol token` prints it
    return SlurmScheduler({"url": cluster.rest_url, "user": "root", "token_file": str(token),
                           "slurm_conf": str(cluster.conf), "timeout_s": 10})


def test_signal_checkpoints_once_then_requeue_resumes(cluster: SlurmCluster, rest: SlurmScheduler,
                                                      tmp_path: Path) -> None:
    log, ckpt, metrics = tmp_path / "job.log", tmp_path / "ckpt", tmp_path / "metrics"
    job = cluster.sbatch(SBATCH, f"--output={log}", env={
        "RM_PYTHON": sys.executable, "RM_TRAIN": str(EXAMPLE), "RM_CKPT_DIR": str(ckpt),
        "ROBUST_METRICS_DIR": str(metrics),
        "RM_MASTER_PORT": str(free_port_block(2))})
    try:
        # watch() has installed its SIGUSR1 handler once the rank registered itself
        wait_until(lambda: list((metrics / "ranks").glob("*.json")), 90, interval=0.3,
                   message=lambda: f"the hook of job {job} to start\n"
                                   f"{job_report(cluster, job, log)}")
        result = rest.signal(job, signal.SIGUSR1)
        assert result.ok and result.data == {"job_id": job, "signal": "SIGUSR1"}
        line = wait_until(lambda: re.search(r"checkpoint at step (\d+)", job_log(log)), 30,
                          message=lambda: f"a checkpoint after SIGUSR1\n{job_log(log)}")
        step = int(line.group(1))
        time.sleep(1.0)  # ~20 more steps: a second checkpoint for the same signal would show
        assert cluster.job_field(job, "JobState") == "RUNNING"
        assert (ckpt / "checkpoint.pt").exists()
        assert len(re.findall(r"checkpoint at step", job_log(log))) == 1, job_log(log)
        assert rest.job(job)["job_state"] == "RUNNING"

        result = rest.restart(job, f"StepHang on run {job}")
        assert result.ok and result.data["job_id"] == job
        assert result.data["job_state"] in ("COMPLETING", "PENDING", "REQUEUED", "CONFIGURING")
        wait_until(lambda: f"resumed from step {step}" in job_log(log), 90, interval=0.3,
                   message=lambda: f"the requeued job to resume from step {step}\n"
                                   f"{job_report(cluster, job, log)}")
        assert "start restart=1" in job_log(log)
        assert cluster.job_field(job, "Restarts") == "1"
        assert rest.job(job)["restart_cnt"] == 1

        assert rest.cancel(job, "test over").ok
        wait_until(lambda: cluster.job_field(job, "JobState") == "CANCELLED", 30,
                   message="the job to be cancelled")
    finally:
        cluster.cli("scancel", job, check=False)


def test_drain_marks_node_drained_with_the_alert_as_reason(cluster: SlurmCluster,
                                                           rest: SlurmScheduler,
                                                           tmp_path: Path) -> None:
    noop = tmp_path / "noop.sh"
    noop.write_text("#!/bin/bash\ntrue\n")
    try:
        result = rest.drain_node(cluster.node, "robust-metrics bridge: GpuXidError on\nrun 42")
        assert result.ok and result.data["reason"] == "robust-metrics bridge: GpuXidError on run 42"
        _, reason = wait_until(lambda: (s := cluster.node_state())[0] == "drained" and s,
                               20, message="the node to show drained")
        assert reason == "robust-metrics bridge: GpuXidError on run 42"
        job = cluster.sbatch(noop, "--output=/dev/null")
        assert cluster.job_field(job, "JobState") == "PENDING"  # nothing starts on it
        cluster.cli("scancel", job)
    finally:
        cluster.cli("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME", check=False)


def test_cli_only_adapter_signals_steps_and_cancels(cluster: SlurmCluster, tmp_path: Path) -> None:
    cli = SlurmScheduler({"slurm_conf": str(cluster.conf), "signal_scope": "steps"})
    out = tmp_path / "steps.log"
    script = tmp_path / "steps.sh"
    script.write_text("#!/bin/bash\n"
                      "srun bash -c 'trap \"echo step got USR1\" USR1; "
                      "for i in $(seq 600); do sleep 0.1; done'\n")
    job = cluster.sbatch(script, f"--output={out}")
    try:
        wait_until(lambda: f"{job}.0" in cluster.cli("squeue", "-h", "-s", "-j", job, "-o",
                                                     "%i").split(),
                   30, message="the srun step to start")
        wait_until(lambda: cli.signal(job, signal.SIGUSR1).ok and "step got USR1" in job_log(out),
                   20, interval=1, message=lambda: f"the step to get SIGUSR1\n{job_log(out)}")
        # the batch shell was not signalled: an untrapped SIGUSR1 would have ended the job
        assert cluster.job_field(job, "JobState") == "RUNNING"
        assert cli.cancel(job, "done").ok
        wait_until(lambda: cluster.job_field(job, "JobState") == "CANCELLED", 30,
                   message="the job to be cancelled")
    finally:
        cluster.cli("scancel", job, check=False)
    with pytest.raises(base.SchedulerError, match="Invalid job id"):
        cli.restart("999999", "no such job")
    with pytest.raises(base.SchedulerError, match="Invalid node name"):
        cli.drain_node("no-such-node", "x")


def test_rest_errors_are_scheduler_errors(cluster: SlurmCluster, rest: SlurmScheduler) -> None:
    with pytest.raises(base.SchedulerError, match="Invalid job id"):
        rest.signal("999999", signal.SIGUSR1)
    with pytest.raises(base.SchedulerError, match="Invalid job id"):
        rest.cancel("999999", "no such job")
    bad = SlurmScheduler({"url": cluster.rest_url, "user": "root", "token": "not-a-jwt"})
    with pytest.raises(base.SchedulerError, match="slurmrestd GET /job/1 failed"):
        bad.job("1")
