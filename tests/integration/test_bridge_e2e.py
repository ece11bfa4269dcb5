"""End to end on real parts: a torchrun job (2 gloo ranks with the hook), the real sidecar, the
bridge. An alert makes the bridge collect the ranks' stacks (py-spy through the sidecar), ask for
a checkpoint and wait for both ranks to acknowledge it, then restart the job through the `local`
scheduler; the new job resumes from the checkpoint.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import alert, serve_app, webhook
from tests.support import EXAMPLE, SidecarProcess, wait_until

TOKEN = "e2e-bridge-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_alert_to_stacks_checkpoint_and_restart_of_a_torchrun_job(tmp_path: Path) -> None:
    from robust_metrics.sidecar.stacks import find_py_spy

    if find_py_spy() is None:  # the sidecar's /debug/stacks
        pytest.skip("py-spy not installed (pip install py-spy; it is in the sidecar extra)")
    metrics_dir = tmp_path / "metrics"
    (tmp_path / "sidecar.token").write_text("side-token\n")
    log = tmp_path / "local-scheduler" / "e2e.log"
    with SidecarProcess(metrics_dir, ["--node", "n1", "--token-file",
                                      str(tmp_path / "sidecar.token"),
                                      "--no-collector.nvml", "--no-collector.nic",
                                      "--no-collector.nccl"],
                        log_path=tmp_path / "sidecar.log") as sidecar:
        raw = {
            "database": "bridge.db", "auth": {"bearer_token": TOKEN},
            "sidecars": {"urls": {"n1": sidecar.url}, "token": "side-token",
                         "ack_poll_s": 0.3, "timeout_s": 30},
            "schedulers": {"local": {
                "type": "local", "stop_timeout_s": 20,
                "command": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", str(EXAMPLE), "--steps=100000",
                            "--step-sleep=0.05", f"--checkpoint-dir={tmp_path / 'ckpt'}"],
                "env": {"ROBUST_METRICS_DIR": str(metrics_dir), "OMP_NUM_THREADS": "1"}}},
            "rules": [{"match": {"alertname": "RankStraggler"}, "actions": [
                "dump_stacks",
                {"type": "restart", "checkpoint_first": True, "require_checkpoint": True,
                 "checkpoint_timeout_s": 60}]}],
        }
        bridge = Bridge(parse(raw, tmp_path))
        local = bridge.schedulers["local"]
        with serve_app(create_app(bridge)) as client:
            try:
                local.start("e2e")

                def steps_of_both_ranks() -> bool:
                    text = httpx.get(f"{sidecar.url}/metrics", timeout=5).text
                    return len(re.findall(r'robust_rank_info\{[^}]*run="e2e"', text)) >= 2

                wait_until(steps_of_both_ranks, 120, 0.5,
                           message=lambda: f"both ranks in the sidecar\n{sidecar.log_tail()}")
                r = client.post("/api/v1/alerts", headers=AUTH, json=webhook(alert(
                    "RankStraggler", fingerprint="e2e1", run="e2e", node="n1")))
                assert r.status_code == 200, r.text
                row = wait_until(lambda: (a := client.get("/api/v1/actions", headers=AUTH)
                                          .json()["actions"]) and a[0]["status"] in (
                    "done", "failed") and a[0], 150, 0.5, message="the chain to finish")
                steps = {s["action"]: s for s in row["steps"]}
                assert row["status"] == "done", row["steps"]
                assert list(steps) == ["dump_stacks", "checkpoint", "restart"]
                assert "stacks of 2 ranks" in steps["dump_stacks"]["detail"]
                assert steps["checkpoint"]["data"]["acknowledged"] == ["n1"]
                request_id = steps["checkpoint"]["data"]["requests"]["n1"]
                assert steps["restart"]["data"]["stopped_pid"]
                resumed = wait_until(
                    lambda: re.findall(r"rank 0: resumed from step (\d+)", log.read_text()), 120,
                    0.5, message="the restarted job to resume from the checkpoint")
                assert int(resumed[0]) > 0
                assert log.read_text().count("checkpoint at step") >= 2  # both ranks
                assert request_id > 0
            finally:
                local.cancel("e2e", "test over")
