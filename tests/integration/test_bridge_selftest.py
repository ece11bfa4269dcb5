"""The bridge's `selftest` step: the run's nodes are tested through their real sidecars, the node
made to fail (a corrupted matmul result injected at the compute check's boundary) is drained
through the scheduler, the restart goes ahead through the `local` scheduler on the rest, and the
ledger keeps every node's verdict. The pure parts (`demarcation`, the config) are tested alone
(tests/test_bridge_selftest.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from robust_metrics.bridge.actions import Actions, StepContext
from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.service import Bridge
from robust_metrics.bridge.sidecars import SidecarClient
from robust_metrics.bridge.store import Incident, Step
from tests.bridge_fakes import Receiver, alert, serve_app, webhook
from tests.support import SidecarProcess, wait_until

TOKEN = "bridge-token"
SIDE_TOKEN = "side-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODES = ("n1", "n2", "n3")
# The nodes share two busy cores and time a 64 x 64 multiply in microseconds, so their FLOP/s
# differ by any factor when one is preempted: the run's-median comparison is off here (0) and
# tested on its own (tests/test_bridge_selftest.py).
STEP = {"type": "selftest", "continue_on_error": True,
        "options": {"scheduler": "ops", "checks": "compute,memory", "quick": True,
                    "drain": True, "timeout_s": 120.0, "min_fraction": 0.0}}


# ---------------------------------------------------------------- real sidecars
@contextlib.contextmanager
def _sidecars(tmp: Path, bad: str = "n2") -> Iterator[dict[str, str]]:
    """A real sidecar per node; `bad`'s self-test subprocess corrupts its matmul result."""
    (tmp / "token").write_text(SIDE_TOKEN)
    with contextlib.ExitStack() as stack:
        urls = {}
        for node in NODES:
            env = {"ROBUST_SELFTEST_FAULT": "compute"} if node == bad else {}
            side = stack.enter_context(SidecarProcess(
                tmp / node, ["--node", node, "--token-file", str(tmp / "token"),
                             "--no-collector.nvml", "--no-collector.nic", "--no-collector.nccl",
                             "--selftest-arg=--memory-bytes=65536", "--selftest-arg=--size=64"],
                log_path=tmp / f"{node}.log", env=env))
            urls[node] = side.url
        yield urls


def _incident(plan: list[dict[str, Any]]) -> Incident:
    labels = {"alertname": "TrainingHang", "run": "r1", "nodes": ",".join(NODES)}
    return Incident(1, "fp@s", "fp", "2026-01-01T00:00:00Z", "r1", "TrainingHang", "r", labels,
                    {}, plan, "running", "", 0, 0, 0, 0, 1)


def test_the_failing_node_is_drained_once_even_when_the_step_resumes(tmp_path: Path) -> None:
    with _sidecars(tmp_path) as urls, Receiver(secret=None) as receiver:
        config = parse({"auth": {"bearer_token": TOKEN},
                        "sidecars": {"urls": urls, "token": SIDE_TOKEN},
                        "schedulers": {"ops": {"type": "webhook", "url": receiver.url}},
                        "rules": [{"match": {"a": "b"}, "actions": ["dump_stacks"]}]})
        sidecars = SidecarClient(config.sidecars)
        actions = Actions(config, sidecars, {"ops": _scheduler(config)}, BridgeMetrics())
        saved: list[dict[str, Any]] = []
        ctx = StepContext(_incident([STEP]), 0, STEP, saved.append)
        outcome = actions.run(ctx)
        assert outcome.status == "success", outcome.detail
        verdicts = outcome.data["verdicts"]
        assert {n: v["verdict"] for n, v in verdicts.items()} == {
            "n1": "pass", "n2": "fail", "n3": "pass"}, verdicts
        assert "silent data corruption" in verdicts["n2"]["detail"]
        assert outcome.data["failed"] == ["n2"]
        drains = receiver.bodies()
        assert [(b["operation"], b["node"]) for b in drains] == [("drain_node", "n2")]
        assert "self-test failed" in drains[0]["reason"]
        # a bridge restart resumes the step from what it saved: no node asked or drained again
        resumed = actions.run(StepContext(_incident([STEP]), 0, STEP, saved.append,
                                          dict(saved[-1]), resumed=True))
        assert resumed.status == "success" and len(receiver.bodies()) == 1
        assert actions.resumable(Step(1, 0, "selftest", "running", "", {}, 0, None),
                                 _incident([STEP]))
        sidecars.close()


def _scheduler(config: Any) -> Any:
    from robust_metrics.bridge.schedulers.base import create

    return create("webhook", config.schedulers["ops"].options)


def test_selftest_drains_the_bad_node_and_the_restart_goes_ahead(tmp_path: Path) -> None:
    """Engine, store, ledger and HTTP as the bridge runs them; the restart through `local`."""
    state = tmp_path / "local-scheduler"
    with _sidecars(tmp_path) as urls, Receiver(secret=None) as receiver:
        raw = {
            "database": "bridge.db", "auth": {"bearer_token": TOKEN},
            "sidecars": {"urls": urls, "token": SIDE_TOKEN},
            "schedulers": {
                "ops": {"type": "webhook", "url": receiver.url},
                "local": {"type": "local", "state_dir": str(state), "stop_timeout_s": 5,
                          "command": [sys.executable, "-c", "import time; time.sleep(120)"]}},
            "default_scheduler": "local",
            "incidents": {"poll": "0.2s"},
            "rules": [{"name": "hang", "match": {"action": "restart"}, "actions": [
                {"type": "selftest", "scheduler": "ops", "checks": ["compute", "memory"],
                 "min_fraction": 0, "continue_on_error": True},
                {"type": "restart"}]}],
        }
        bridge = Bridge(parse(raw, tmp_path))
        local = bridge.schedulers["local"]
        with serve_app(create_app(bridge)) as client:
            try:
                assert local.start("r1").ok
                first = local.state("r1")["pid"]
                r = client.post("/api/v1/alerts", headers=AUTH, json=webhook(alert(
                    "TrainingHang", run="r1", action="restart", severity="critical",
                    nodes="n1,n2,n3")))
                assert r.status_code == 200, r.text
                entry = wait_until(lambda: _ledger(client), 90, 0.2,
                                   message="the incident in the ledger")
                restarted = local.state("r1")
            finally:
                local.cancel("r1", "test over")
        assert entry["outcome"] == "not_recovered"  # no Prometheus to see it recover
        assert entry["nodes"] == ["n1", "n2", "n3"]  # the alert's `nodes` label names them all
        assert {n: (v["verdict"], v["drained"]) for n, v in entry["selftest"].items()} == {
            "n1": ("pass", False), "n2": ("fail", True), "n3": ("pass", False)}, entry["selftest"]
        assert entry["selftest"]["n2"]["failed"] == ["compute"]
        assert [(b["operation"], b["node"]) for b in receiver.bodies()] == [("drain_node", "n2")]
        assert restarted["last_key"].endswith("#1")  # the restart step ran
        assert restarted["pid"] != first


def _ledger(client: Any) -> dict[str, Any] | None:
    r = client.get("/api/v1/incidents", headers=AUTH)
    entries = r.json().get("incidents") if r.status_code == 200 else None
    return entries[0] if entries else None
