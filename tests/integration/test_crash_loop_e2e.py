"""The crash-loop guard on real parts: a torchrun job whose rank 1 raises right after global step 9
in every start, faster than the 1 s scrapes can see it step; the real sidecar, Prometheus,
Alertmanager and the bridge with its `local` scheduler.

The step evidence must survive the crash: the sidecar reads a dead rank's last step, start step
and last step time from its files, so the guard sees step 9 after every start and stops at
exactly the configured count, and the ledger sees every restart recover with 4 lost steps,
however the scrapes fell. A restart that fails again before any scrape saw it alive is a new
RankExited (its pid differs), and the rank that raised is named, not the peer torchrun stopped
(the rank wrote when the exception ended it). `ROBUST_CRASH_LOOP_REPEATS=5` repeats it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from robust_metrics.demo.stack import DemoStack
from robust_metrics.processes import wait_for
from tests.support import require_binary

CRASH_STEP = 9
LOOP_RESTARTS = 2
REPEATS = int(os.environ.get("ROBUST_CRASH_LOOP_REPEATS", "1"))  # 5 for the full check


class CrashLoopStack(DemoStack):
    """The demo's stack with a policy that restarts on every crash and guards the loop."""

    def _bridge_config(self) -> dict[str, Any]:
        config = super()._bridge_config()
        local = config["schedulers"]["local"]
        local["command"] = [*local["command"], "--checkpoint-every=5", "--trace-every=0"]
        config["restart_budget"] = {"max_restarts": 20, "window": "1h"}
        config["incidents"] = {"crash_loop_restarts": LOOP_RESTARTS}
        config["rules"] = [{"name": "crash", "match": {"alertname": "RankExited"},
                            "actions": ["restart"]}]
        return config


def crash_actions(stack: DemoStack) -> list[dict[str, Any]]:
    """The bridge's incidents of the run's RankExited alerts, with their steps."""
    return [i for i in stack.actions() if i.get("alertname") == "RankExited"]


def guard_reason(incident: dict[str, Any]) -> str | None:
    return next((s["detail"] for s in incident.get("steps", [])
                 if "crash loop" in str(s.get("detail"))), None)


@pytest.mark.parametrize("repeat", range(max(REPEATS, 1)))
def test_the_guard_stops_a_crash_loop_at_exactly_the_configured_count(
        tmp_path: Path, repeat: int) -> None:
    require_binary("prometheus")
    require_binary("prometheus-alertmanager", "alertmanager")
    stack = CrashLoopStack(tmp_path / "stack", ranks=2, step_sleep=0.02)
    (stack.job_dir / "faults.json").write_text(json.dumps(
        {"crash_rank": 1, "crash_step": CRASH_STEP}))
    stack.start()
    try:
        stack.start_job()
        wait_for(lambda: any(guard_reason(i) for i in crash_actions(stack)), timeout=240,
                 interval=1.0, message="the crash-loop guard to stop the restarts")
        time.sleep(8)  # a restart past the guard would show up by now
        incidents = crash_actions(stack)
        restarts = [s for i in incidents for s in i.get("steps", [])
                    if s.get("action") == "restart" and s.get("status") == "success"]
        assert len(restarts) == LOOP_RESTARTS, json.dumps(incidents, indent=1)[-4000:]
        # every start reached step 9, though no scrape saw it alive: the dead rank's files did
        assert [s["data"]["highest_step"] for s in restarts] == [CRASH_STEP] * LOOP_RESTARTS
        guards = [guard_reason(i) for i in incidents if guard_reason(i)]
        assert len(guards) == 1 and f"highest step ({CRASH_STEP})" in guards[0], guards
        ledger = {i["incident_id"]: i for i in stack.incidents() if i["alertname"] == "RankExited"}
        outcomes = sorted(i["outcome"] for i in ledger.values())
        assert outcomes == ["crash_loop"] + ["recovered"] * LOOP_RESTARTS, ledger
        # each start resumed from the checkpoint of step 5 and lost the 4 steps after it
        assert {i["lost_steps"] for i in ledger.values() if i["outcome"] == "recovered"} == {
            CRASH_STEP - 5}, ledger
    finally:
        stack.stop()
