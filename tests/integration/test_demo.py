"""`robust-metrics demo` end to end, headless, in its short mode: every injected fault is caught
by the right alert for the right rank, the bridge acts once per alert, the job resumes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support import ROOT, require_binary


def run_demo(out: Path, *args: str, timeout: float) -> dict:
    require_binary("prometheus")
    require_binary("prometheus-alertmanager", "alertmanager")
    proc = subprocess.run([sys.executable, "-m", "robust_metrics", "demo", "--out", str(out),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    reports = sorted(out.glob("*/report/report.json"))
    assert reports, f"no report written (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n" \
                    f"{proc.stderr[-4000:]}"
    report = json.loads(reports[-1].read_text())
    report["_exit"], report["_stdout"] = proc.returncode, proc.stdout
    return report


def test_every_fault_is_detected_acted_on_once_and_the_job_resumes(tmp_path: Path) -> None:
    report = run_demo(tmp_path, "--duration", "150", timeout=600)
    faults = {f["alert"]: f for f in report["faults"]}
    assert set(faults) == {"SlowRank", "NonFiniteLoss", "RankHang"}, report["_stdout"][-3000:]
    for alert, fault in faults.items():
        assert fault["detected_at"] is not None, f"{alert} not detected\n{report['_stdout']}"
        assert fault["alert_rank"] == str(fault["rank"]), fault
    incidents = [i for i in report["incidents"] if i["steps"]]
    steps = Counter((i["alertname"], s["action"]) for i in incidents for s in i["steps"])
    assert steps[("SlowRank", "checkpoint")] == 1, steps
    assert steps[("RankHang", "restart")] == 1, steps
    assert steps[("RankHang", "dump_stacks")] == 1, steps
    # TrainingHang fires with RankHang; its stack dump may come after the restart and find no
    # ranks, which is not one of the demo's promises
    # the bridge's own restart ends every rank: no crash, so no RankExited, not even one that a
    # cooldown would have kept from acting
    assert not [i for i in report["incidents"] if i["alertname"] == "RankExited"], incidents
    acted = [i for i in incidents if i["alertname"] in ("SlowRank", "RankHang")]
    assert all(i["status"] == "done" for i in acted), acted
    assert report["resumed_from_step"] is not None and report["resumed_from_step"] > 0
    # the restart's ledger entry is complete: recovered, with its lost steps
    (hang,) = [e for e in report["ledger"] if e["alertname"] == "RankHang"]
    assert hang["outcome"] == "recovered" and hang["recover_s"] is not None, hang
    assert hang["lost_steps"] is not None and hang["lost_steps"] >= 0, hang
    # the report's ETTR is the breakdown's productive share (the estimate from unique steps x
    # the current median step time is only reported: the slow rank and a loaded machine make
    # the step time unsteady, which it assumes away)
    parts, ettr = report["badput"], report["ettr"]
    share = parts["productive"] / sum(parts.values())
    assert share == pytest.approx(ettr["since_start"], abs=0.02), (parts, ettr)
    assert parts["productive"] > 0 and parts["hang"] < 0.5 * sum(parts.values()), parts
    assert report["_exit"] == 0, report["_stdout"][-3000:]


def test_a_healthy_run_raises_no_alert(tmp_path: Path) -> None:
    report = run_demo(tmp_path, "--no-faults", "--duration", "60", timeout=400)
    assert report["alerts_fired"] == [], report["alerts_fired"]
    assert report["_exit"] == 0
