"""The incident ledger on real parts: a torchrun job (2 gloo ranks, a checkpoint every 3 steps)
whose rank 1 hangs at step 5; the hang alert reaches the bridge, which restarts the job through
the `local` scheduler; the job resumes from the checkpoint of step 3. The ledger, read from the
bridge's API and metrics, shows when the fault happened (the last step, from Prometheus), when
the bridge heard of it, acted and saw the first step again, and exactly 2 lost steps."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.bridge_fakes import alert, webhook
from tests.incident_parts import AUTH, RUN, incident_parts
from tests.support import wait_until

pytestmark = pytest.mark.integration


def _metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_hang_restart_resume_enters_detect_act_recover_and_lost_steps(tmp_path: Path) -> None:
    job = ["--steps=100000", "--step-sleep=1.0", "--hang-rank=1", "--hang-step=5",
           f"--checkpoint-dir={tmp_path / 'ckpt'}", "--checkpoint-every=3"]
    rules = [{"name": "hang", "match": {"alertname": "TrainingHang"}, "actions": ["restart"]}]
    with incident_parts(tmp_path, job, rules, {}) as parts:
        parts.local.start(RUN)
        sel = f'{{run="{RUN}"}}'
        wait_until(lambda: parts.scalar(f"max(robust_global_step{sel})") == 5, 120, 0.5,
                   message=f"the job to reach step 5\n{parts.job_log.read_text()[-3000:]}")
        time.sleep(3)  # the hang goes unnoticed for a while, as it would under a rule's `for`
        last_step = parts.scalar(f"max(robust_last_step_timestamp_seconds{sel})")
        assert last_step is not None
        starts = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        r = parts.client.post("/api/v1/alerts", headers=AUTH, json=webhook(alert(
            "TrainingHang", fingerprint="hang1", starts_at=starts, run=RUN)))
        assert r.status_code == 200, r.text

        def entered() -> dict | None:
            rows = parts.get("/api/v1/incidents", run=RUN)["incidents"]
            return rows[0] if rows and rows[0]["final"] else None

        entry = wait_until(entered, 150, 0.5, message="the ledger to enter the incident\n"
                           + parts.job_log.read_text()[-3000:])
        resumed = re.findall(r"rank 0: resumed from step (\d+)", parts.job_log.read_text())
        assert resumed == ["3"]
        assert entry["outcome"] == "recovered" and entry["alertname"] == "TrainingHang"
        assert (entry["highest_step"], entry["resumed_step"], entry["lost_steps"]) == (5, 3, 2)
        assert entry["fault"] == pytest.approx(last_step, abs=1e-3)  # the hang's last step
        assert entry["fault"] < entry["detected"] < entry["acted"] < entry["recovered"]
        assert entry["detect_s"] >= 3.0
        assert entry["act_s"] > 0 and entry["recover_s"] > 0
        print(f"\nledger: detect {entry['detect_s']:.2f}s, act {entry['act_s']:.2f}s, "
              f"recover {entry['recover_s']:.2f}s, lost steps {entry['lost_steps']}")

        text = parts.client.get("/metrics").text
        assert _metric(text, "robust_bridge_incident_lost_steps_total",
                       alertname="TrainingHang") == 2
        for name in ("detect", "act", "recover"):
            assert _metric(text, f"robust_bridge_incident_{name}_seconds_count",
                           alertname="TrainingHang") == 1
        assert _metric(text, "robust_bridge_incidents_total", alertname="TrainingHang",
                       outcome="recovered") == 1
        # The API is authenticated, and bad input is a 4xx with a message
        assert parts.client.get("/api/v1/incidents").status_code == 401
        bad = parts.client.get("/api/v1/incidents", headers=AUTH, params={"limit": "0"})
        assert bad.status_code == 400 and "limit" in bad.json()["error"]
