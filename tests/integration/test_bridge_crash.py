"""kill -9 of the bridge in the middle of an action, then a restart: nothing lost, nothing doubled.

The bridge runs as a real process (`python -m robust_metrics bridge`). Three cases:
- a `local` restart interrupted while the old job is still stopping: the new bridge sees the step
  `running`, asks the scheduler whether it completed (it did not), and finishes it: one new job;
- a `webhook` restart interrupted while the receiver holds the request: the outcome is unknowable,
  so the step is marked failed and not sent again: the receiver sees exactly one request;
- a checkpoint interrupted while waiting for the ranks' acknowledgement: the wait resumes, the
  sidecar is not asked again.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from robust_metrics.bridge.schedulers.local import LocalScheduler
from tests.bridge_fakes import (
    BridgeProcess,
    FakeSidecar,
    Receiver,
    alert,
    webhook,
    write_config,
)
from tests.support import free_port, wait_until

TOKEN = "crash-token"

JOB = """
import os, signal, sys, time
log = sys.argv[1]
def on_term(signum, frame):
    open(log, "a").write(f"term {os.getpid()}\\n")
    time.sleep(3)  # a job that takes a while to stop: the restart is in flight meanwhile
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(log, "a").write(f"start {os.getpid()}\\n")
while True:
    time.sleep(0.1)
"""


def send(bridge: BridgeProcess, payload: dict[str, Any]) -> None:
    r = httpx.post(f"{bridge.url}/api/v1/alerts", json=payload,
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text


def running_steps(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT action, status FROM steps WHERE status='running'").fetchall()


def saved_requests(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT data FROM steps").fetchall()
    return dict(json.loads(rows[0][0]).get("requests") or {}) if rows else {}


def lines(path: Path, word: str) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.startswith(word)] if path.exists() \
        else []


def test_local_restart_interrupted_by_kill9_is_finished_once(tmp_path: Path) -> None:
    events = tmp_path / "events.txt"
    (tmp_path / "job.py").write_text(JOB)
    scheduler_cfg = {"type": "local", "command": [sys.executable, str(tmp_path / "job.py"),
                                                  str(events)],
                     "state_dir": str(tmp_path / "state"), "stop_timeout_s": 10}
    config = write_config(tmp_path / "bridge.yaml", {
        "database": "bridge.db", "auth": {"bearer_token": TOKEN},
        "schedulers": {"local": scheduler_cfg},
        "rules": [{"match": {"action": "restart"}, "actions": ["restart"]}]})
    local = LocalScheduler({k: v for k, v in scheduler_cfg.items() if k != "type"},
                           base_dir=tmp_path)
    bridge = BridgeProcess(config, free_port(), TOKEN, tmp_path / "bridge.log")
    try:
        local.start("job-a")
        wait_until(lambda: lines(events, "start"), 10, message="the job to start")
        bridge.start()
        send(bridge, webhook(alert("RankHang", fingerprint="k1", run="job-a", action="restart")))
        wait_until(lambda: lines(events, "term"), 15, message="the restart to begin")
        bridge.kill9()  # the old job is still stopping; the new one is not started
        assert running_steps(tmp_path / "bridge.db") == [("restart", "running")]
        bridge.start()
        rows = wait_until(lambda: (r := bridge.actions(run="job-a")) and r[0]["status"] in (
            "done", "failed") and r, 30, message=lambda: f"the resumed restart\n{bridge.log()}")
        assert rows[0]["status"] == "done", rows
        wait_until(lambda: len(lines(events, "start")) == 2, 10, message="the new job")
        send(bridge, webhook(alert("RankHang", fingerprint="k1", run="job-a", action="restart")))
        time.sleep(2)  # a doubled restart would start a third job by now
        assert len(lines(events, "start")) == 2, events.read_text()
        new_pid = int(lines(events, "start")[1].split()[1])
        assert local.state("job-a")["pid"] == new_pid and local.running("job-a")
        assert "resumed after a bridge restart" in bridge.log()
    finally:
        bridge.kill9()
        local.cancel("job-a", "test over")


def test_webhook_restart_interrupted_by_kill9_is_not_sent_twice(tmp_path: Path) -> None:
    with Receiver(secret=None, delay_s=4) as ops:
        config = write_config(tmp_path / "bridge.yaml", {
            "database": "bridge.db", "auth": {"bearer_token": TOKEN},
            "schedulers": {"ops": {"type": "webhook", "url": ops.url}},
            "rules": [{"match": {"action": "restart"}, "actions": ["restart", "dump_stacks"]}]})
        bridge = BridgeProcess(config, free_port(), TOKEN, tmp_path / "bridge.log")
        try:
            bridge.start()
            send(bridge, webhook(alert("RankHang", fingerprint="w1", run="job-b",
                                       action="restart")))
            wait_until(lambda: ops.bodies(), 15, message="the restart request to arrive")
            bridge.kill9()
            bridge.start()
            rows = wait_until(lambda: (r := bridge.actions(run="job-b")) and r[0]["status"] in (
                "done", "failed") and r, 30, message="recovery")
            step = rows[0]["steps"][0]
            assert (step["action"], step["status"]) == ("restart", "failed")
            assert "not repeated" in step["detail"]
            assert len(rows[0]["steps"]) == 1  # the chain stopped; nothing ran after it
            time.sleep(5)  # longer than the receiver's delay: a re-send would have arrived
            assert len(ops.bodies()) == 1
            assert json.loads(json.dumps(ops.bodies()[0]))["run"] == "job-b"
        finally:
            bridge.kill9()


def test_checkpoint_wait_resumes_after_kill9_without_asking_again(tmp_path: Path) -> None:
    with FakeSidecar(node="n1", run="job-c", ranks=[0, 1], ack=False) as side:
        config = write_config(tmp_path / "bridge.yaml", {
            "database": "bridge.db", "auth": {"bearer_token": TOKEN},
            "sidecars": {"urls": {"n1": side.url}, "token": "side-token", "ack_poll_s": 0.2},
            "rules": [{"match": {"alertname": "Straggler"},
                       "actions": [{"type": "checkpoint", "timeout_s": 60}]}]})
        bridge = BridgeProcess(config, free_port(), TOKEN, tmp_path / "bridge.log")
        try:
            bridge.start()
            send(bridge, webhook(alert("Straggler", fingerprint="c1", run="job-c", node="n1")))
            wait_until(lambda: side.checkpoint_requests, 15, message="the checkpoint request")
            wait_until(lambda: saved_requests(tmp_path / "bridge.db"), 10,
                       message="the request id to be saved (the step now waits for the ack)")
            assert running_steps(tmp_path / "bridge.db") == [("checkpoint", "running")]
            bridge.kill9()
            bridge.start()
            side.acknowledge(side.next_id)  # the ranks finish the checkpoint meanwhile
            rows = wait_until(lambda: (r := bridge.actions(run="job-c")) and r[0]["status"] in (
                "done", "failed") and r, 30, message=lambda: f"the resumed wait\n{bridge.log()}")
            assert rows[0]["status"] == "done", rows
            assert len(side.checkpoint_requests) == 1  # not asked a second time
            assert rows[0]["steps"][0]["data"]["requests"] == {"n1": side.next_id}
        finally:
            bridge.kill9()
