"""The incident ledger on real parts: a torchrun job (2 gloo ranks, a checkpoint every 3 steps)
whose rank 1 hangs at step 5; the hang alert reaches the bridge, which restarts the job through
the `local` scheduler; the job resumes from the checkpoint of step 3. The ledger, read from the
bridge's API and metrics, shows when the fault happened (the last step, from Prometheus), when
the bridge heard of it, acted and saw the first step again, and exactly 2 lost steps. The same
Prometheus evaluates the badput rules: hang, restart, recomputed and productive time add up to
the wall time within two evaluation intervals (1 s)."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from robust_metrics.rules import RULES_DIR
from tests.bridge_fakes import alert, webhook
from tests.incident_parts import AUTH, RUN, Parts, incident_parts
from tests.support import wait_until


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
    rule_files = [RULES_DIR / "node_summaries.yml", RULES_DIR / "training.yml",
                  RULES_DIR / "badput.yml"]
    with incident_parts(tmp_path, job, rules, {}, rule_files=rule_files) as parts:
        parts.local.start(RUN)
        sel = f'{{run="{RUN}"}}'
        wait_until(lambda: parts.scalar(f"max(robust_global_step{sel})") == 5, 120, 0.5,
                   message=lambda: f"the job to reach step 5\n{parts.job_log.read_text()[-3000:]}")
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
        _check_badput(parts)
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


def _check_badput(parts: Parts) -> None:
    """The badput causes of the run add up to its wall time, and the fault shows in them."""
    sel = f'{{run="{RUN}"}}'
    # the job redoes steps 4 and 5 (and hangs at 5 again, as the fault job does each launch)
    wait_until(lambda: (parts.scalar(f"max(robust_global_step{sel})") or 0) >= 5, 60, 0.5,
               message="the job to redo its lost steps\n" + parts.prom.logs())
    time.sleep(2)
    result = parts.prom.query(f"run:robust_badput_seconds:total{sel}")
    causes = {r["metric"]["cause"]: float(r["value"][1]) for r in result}
    wall = parts.scalar(f"time() - run:robust_run_start_timestamp_seconds:min{sel}")
    assert wall is not None and wall > 0
    print("badput: " + ", ".join(f"{c} {v:.1f}s" for c, v in sorted(causes.items()))
          + f"; sum {sum(causes.values()):.1f}s, wall {wall:.1f}s")
    # the totals are as of the badput group's last evaluation and the start is the ETTR
    # group's first: each may be one evaluation interval (0.5 s) off the instant of the query
    assert sum(causes.values()) == pytest.approx(wall, abs=1.0)
    for cause in ("productive", "hang", "restart", "recomputed"):
        assert causes.get(cause, 0) > 0, causes
