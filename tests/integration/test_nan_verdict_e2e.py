"""Transient vs persistent non-finite values on real parts: a torchrun job of 2 gloo ranks (rank 1
computes a NaN loss at global step 7; checkpoints every 5 steps), the real sidecar, Prometheus,
and the bridge restarting the job through the `local` scheduler.

- A NaN that follows the data comes back at step 7 after the restart from step 5: the ledger
  enters `persistent` with the step and rank, people are told, and the next NaN alert of the run
  is a notification instead of another restart.
- A one-off NaN (`--nan-once`, as a faulty machine would give) does not come back: the ledger
  enters `transient`, names the node of rank 1 and runs a compute self-test on it.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.bridge_fakes import alert, webhook
from tests.incident_parts import AUTH, RUN, Parts, incident_parts
from tests.support import wait_until

JOB = ["--steps=100000", "--step-sleep=2.0", "--nan-rank=1", "--nan-step=6",
       "--checkpoint-every=5"]
RULES = [{"name": "nan", "match": {"alertname": "NonFiniteLoss"}, "actions": ["restart"]}]
SEL = f'{{run="{RUN}"}}'


def _nan_alert(parts: Parts, fingerprint: str) -> None:
    starts = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    r = parts.client.post("/api/v1/alerts", headers=AUTH, json=webhook(alert(
        "NonFiniteLoss", fingerprint=fingerprint, starts_at=starts, run=RUN, rank="1",
        node="n1")))
    assert r.status_code == 200, r.text


def _entry(parts: Parts, n: int = 1) -> dict[str, Any] | None:
    rows = parts.get("/api/v1/incidents", run=RUN)["incidents"]
    final = [r for r in rows if r["final"]]
    return final[0] if len(final) >= n else None


def _first_nan(parts: Parts) -> None:
    wait_until(lambda: parts.scalar(f"max(robust_nonfinite_first_step{SEL})") == 7, 150, 0.5,
               message=lambda: f"the NaN at step 7\n{parts.job_log.read_text()[-3000:]}")


def test_a_nan_that_follows_the_data_is_persistent_and_stops_the_restarts(
        tmp_path: Path) -> None:
    job = [*JOB, f"--checkpoint-dir={tmp_path / 'ckpt'}"]
    with incident_parts(tmp_path, job, RULES, {}, sidecar_token="side-token") as parts:
        parts.local.start(RUN)
        _first_nan(parts)
        _nan_alert(parts, "nan1")
        entry = wait_until(lambda: _entry(parts), 180, 0.5, message="the ledger's verdict\n"
                           + parts.job_log.read_text()[-3000:])
        assert re.findall(r"rank 0: resumed from step (\d+)", parts.job_log.read_text()) == ["5"]
        numerics = entry["numerics"]
        assert (numerics["verdict"], numerics["step"], numerics["rank"], numerics["node"]) == (
            "persistent", 7, "1", "n1")
        assert numerics["recurred_step"] == 7
        assert "restarts stopped" in entry["note"]
        told = [b for b in parts.receiver.bodies("/notify") if b.get("verdict") == "persistent"]
        assert len(told) == 1 and (told[0]["step"], told[0]["rank"]) == (7, "1")

        _nan_alert(parts, "nan2")  # the NaN is still there: another alert of the run

        def escalated() -> list[dict[str, Any]]:
            return [b for b in parts.receiver.bodies("/notify")
                    if "not restarting it again" in str(b.get("message"))]

        (notice,) = wait_until(escalated, 60, 0.5, message="the refused restart's notify")
        assert "came back at step 7" in notice["message"]
        assert re.findall(r"resumed from step", parts.job_log.read_text()).count(
            "resumed from step") == 2  # two ranks resumed once: no second restart


def test_a_one_off_nan_is_transient_and_its_node_gets_a_compute_selftest(tmp_path: Path) -> None:
    job = [*JOB, "--nan-once", f"--checkpoint-dir={tmp_path / 'ckpt'}"]
    with incident_parts(tmp_path, job, RULES, {}, sidecar_token="side-token") as parts:
        parts.local.start(RUN)
        _first_nan(parts)
        _nan_alert(parts, "nan1")
        entry = wait_until(lambda: _entry(parts), 240, 0.5, message="the ledger's verdict\n"
                           + parts.job_log.read_text()[-3000:])
        numerics = entry["numerics"]
        assert (numerics["verdict"], numerics["step"], numerics["rank"], numerics["node"]) == (
            "transient", 7, "1", "n1")
        assert "n1" in entry["nodes"]
        assert entry["selftest"]["n1"]["verdict"] == "pass", entry["selftest"]
        assert entry["selftest"]["n1"]["digest"]  # the compute check ran on the node
        assert parts.scalar(f"max(robust_global_step{SEL})") >= 9
        assert not [b for b in parts.receiver.bodies("/notify") if b.get("verdict")]
