"""The bridge drives a real Slurm: alerts checkpoint (SIGUSR1) and requeue a job, and drain a node.

The bridge runs in-process behind its real HTTP app (as in test_bridge_app.py) with a `slurm`
scheduler pointed at the test cluster's slurmrestd; the alerts are the webhook payloads
Alertmanager sends. What is checked is Slurm's own view: the job's restart count, the training
script starting again, and the node's drain state and reason; and the training script's own log
for the checkpoint, which reaches the job as SIGUSR1 through the scheduler (no sidecar configured).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.slurm_cluster import SlurmCluster
from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import alert, serve_app, webhook
from tests.slurm.fixture import job_log, job_report, slurm_cluster
from tests.support import EXAMPLE, ROOT, free_port_block, wait_until

__all__ = ["slurm_cluster"]  # the module fixture, imported for pytest

SBATCH = ROOT / "tests" / "slurm" / "train.sbatch"
TOKEN = "bridge-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture
def bridge(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[httpx.Client]:
    (tmp_path / "jwt").write_text(slurm_cluster.token())
    raw: dict[str, Any] = {
        "database": str(tmp_path / "bridge.db"), "auth": {"bearer_token": TOKEN},
        "schedulers": {"cluster": {"type": "slurm", "url": slurm_cluster.rest_url,
                                   "user": "root", "token_file": "jwt",
                                   "slurm_conf": str(slurm_cluster.conf)}},
        "rules": [
            {"name": "checkpoint", "match": {"alertname": "LossSpike"}, "actions": ["checkpoint"]},
            {"name": "requeue-hung", "match": {"alertname": "StepHang"}, "scheduler": "cluster",
             "actions": ["restart"]},
            {"name": "drain-xid", "match": {"alertname": "GpuXidError"}, "scheduler": "cluster",
             "actions": ["drain_node"]},
        ]}
    service = Bridge(parse(raw, tmp_path))  # token_file relative to the policy folder
    with serve_app(create_app(service)) as client:
        yield client


def _actions(client: httpx.Client) -> list[dict[str, Any]]:
    r = client.get("/api/v1/actions", headers=AUTH)
    assert r.status_code == 200, r.text
    return list(r.json()["actions"])


def _settled(client: httpx.Client, rule: str) -> dict[str, Any]:
    final = {"done", "failed", "skipped", "cancelled"}
    return wait_until(lambda: next((a for a in _actions(client) if a.get("rule") == rule
                                    and a["status"] in final), None), 60, interval=0.3,
                      message=lambda: f"the bridge to finish rule {rule}: {_actions(client)}")


def test_alerts_checkpoint_and_requeue_the_job_and_drain_the_node(slurm_cluster: SlurmCluster,
                                                   bridge: httpx.Client, tmp_path: Path) -> None:
    c = slurm_cluster
    log, metrics = tmp_path / "job.log", tmp_path / "metrics"
    job = c.sbatch(SBATCH, f"--output={log}", env={
        "RM_PYTHON": sys.executable, "RM_TRAIN": str(EXAMPLE), "RM_CKPT_DIR": str(tmp_path / "ck"),
        "ROBUST_METRICS_DIR": str(metrics),
        "RM_MASTER_PORT": str(free_port_block(2))})
    try:
        wait_until(lambda: list((metrics / "ranks").glob("*.json")), 90, interval=0.3,
                   message=lambda: f"job {job} to start training\n{job_report(c, job, log)}")
        r = bridge.post("/api/v1/alerts", headers=AUTH, content=json.dumps(
            webhook(alert("LossSpike", fingerprint="spike1", run=job))))
        assert r.status_code == 200, r.text
        done = _settled(bridge, "checkpoint")
        assert done["status"] == "done", _actions(bridge)
        assert done["steps"][0]["data"]["signal"] == "SIGUSR1", done
        wait_until(lambda: "checkpoint at step" in job_log(log), 30, interval=0.3,
                   message=lambda: f"a checkpoint after SIGUSR1\n{job_log(log)}")
        time.sleep(1.0)  # ~20 more steps: a second checkpoint for the same alert would show
        assert job_log(log).count("checkpoint at step") == 1, job_log(log)

        r = bridge.post("/api/v1/alerts", headers=AUTH, content=json.dumps(
            webhook(alert("StepHang", fingerprint="hang1", run=job))))
        assert r.status_code == 200, r.text
        assert _settled(bridge, "requeue-hung")["status"] == "done", _actions(bridge)
        wait_until(lambda: "start restart=1" in job_log(log), 60, interval=0.3,
                   message=lambda: f"the requeued job to start again\n{job_log(log)}")
        assert c.job_field(job, "Restarts") == "1"

        r = bridge.post("/api/v1/alerts", headers=AUTH, content=json.dumps(
            webhook(alert("GpuXidError", fingerprint="xid1", run=job, node=c.node))))
        assert r.status_code == 200, r.text
        assert _settled(bridge, "drain-xid")["status"] == "done", _actions(bridge)
        state, reason = c.node_state()
        assert state in ("draining", "drained")  # the job still runs on it: draining
        assert reason.startswith(f"robust-metrics bridge: GpuXidError on run {job}")
        c.cli("scancel", job)
        wait_until(lambda: c.node_state()[0] == "drained", 30, message="the node to be drained")
    finally:
        c.cli("scancel", job, check=False)
        c.cli("scontrol", "update", f"NodeName={c.node}", "State=RESUME", check=False)
