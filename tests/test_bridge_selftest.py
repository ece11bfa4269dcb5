"""The bridge's `selftest` step, its pure parts: `demarcation` (who is blamed), the policy's
options, and the ledger's verdicts. Through real sidecars:
tests/integration/test_bridge_selftest.py."""

from __future__ import annotations

from typing import Any

import pytest

from robust_metrics.bridge.config import ConfigError, parse
from robust_metrics.bridge.demarcation import node_verdict, peer_outliers
from robust_metrics.bridge.ledger import named, selftest_verdicts
from robust_metrics.bridge.store import Incident, Step


# ---------------------------------------------------------------- pure parts
def _verdict(digest: str, flops: float, verdict: str = "pass") -> dict[str, Any]:
    return {"verdict": verdict, "failed": [], "detail": "", "digest": digest, "flops": flops}


def test_a_digest_outvoted_by_a_strict_majority_is_blamed() -> None:
    verdicts = {"a": _verdict("x" * 64, 1e9), "b": _verdict("x" * 64, 1e9),
                "c": _verdict("y" * 64, 1e9)}
    assert list(peer_outliers(verdicts)) == ["c"]
    assert "silent data corruption" in peer_outliers(verdicts)["c"]
    # two nodes cannot say which one is wrong; no majority among three cannot either
    assert peer_outliers({"a": _verdict("x" * 64, 1e9), "b": _verdict("y" * 64, 1e9)}) == {}
    assert peer_outliers({"a": _verdict("x" * 64, 1e9), "b": _verdict("y" * 64, 1e9),
                          "c": _verdict("z" * 64, 1e9)}) == {}


def test_a_node_far_below_the_runs_median_flops_is_blamed() -> None:
    verdicts = {"a": _verdict("d", 10e9), "b": _verdict("d", 9e9), "c": _verdict("d", 3e9)}
    out = peer_outliers(verdicts, 0.5)
    assert list(out) == ["c"] and "below 0.5 x the run's median" in out["c"]
    assert peer_outliers(verdicts, 0.3) == {}


def test_node_verdict_keeps_failed_checks_and_the_compute_figures() -> None:
    report = {"verdict": "fail", "results": [
        {"check": "compute", "verdict": "pass", "figure": 2e9, "detail": "ok",
         "data": {"digest": "ab" * 32}},
        {"check": "memory", "verdict": "fail", "figure": 1.0, "detail": "byte 7 read back"}]}
    assert node_verdict(report) == {"verdict": "fail", "failed": ["memory"],
                                    "detail": "memory: byte 7 read back", "digest": "ab" * 32,
                                    "flops": 2e9}


def _config(**step: Any) -> dict[str, Any]:
    return {"auth": {"bearer_token": "t"},
            "schedulers": {"ops": {"type": "webhook", "url": "http://127.0.0.1:1"}},
            "default_scheduler": "ops",
            "rules": [{"name": "r", "match": {"action": "restart"},
                       "actions": [{"type": "selftest", **step}, "restart"]}]}


def test_the_policy_accepts_and_checks_selftest_options() -> None:
    spec = parse(_config(checks=["compute", "gpu"], quick=False)).rules[0].actions[0]
    assert spec.options["checks"] == "compute,gpu" and spec.options["quick"] is False
    assert spec.options["drain"] is True
    with pytest.raises(ConfigError, match=r"actions\[0\].checks: a list of self-test checks"):
        parse(_config(checks=["disk"]))
    with pytest.raises(ConfigError, match="unknown key"):
        parse(_config(nodes=3))
    raw = _config()
    del raw["schedulers"], raw["default_scheduler"]
    raw["rules"][0]["actions"] = [{"type": "selftest"}]
    with pytest.raises(ConfigError, match="action selftest needs a scheduler"):
        parse(raw)
    raw["rules"][0]["actions"] = [{"type": "selftest", "drain": False}]
    assert parse(raw).rules[0].actions[0].options["drain"] is False


def test_the_ledger_names_failed_nodes_and_keeps_every_verdict() -> None:
    incident = Incident(1, "fp@s", "fp", "2026-01-01T00:00:00Z", "r1", "TrainingHang", "r",
                        {"alertname": "TrainingHang", "run": "r1"}, {}, [], "done", "", 0, 0, 0,
                        0, 1)
    step = Step(1, 0, "selftest", "success", "", {
        "verdicts": {"n1": {"verdict": "pass"}, "n2": {"verdict": "fail", "failed": ["compute"],
                                                       "detail": "digests differ"},
                     "n3": {"verdict": "error", "detail": "unreachable"}},
        "drained": {"n2": {"ok": True, "detail": "accepted"}}}, 0, 1)
    assert named(incident, [step]) == ([], ["n2"])
    assert selftest_verdicts([step]) == {
        "n1": {"verdict": "pass", "failed": [], "detail": "", "drained": False},
        "n2": {"verdict": "fail", "failed": ["compute"], "detail": "digests differ",
               "drained": True},
        "n3": {"verdict": "error", "failed": [], "detail": "unreachable", "drained": False}}
