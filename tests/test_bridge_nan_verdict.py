"""Transient or persistent non-finite values: after a NaN incident and a restart, a NaN at the
same step again is `persistent` (the restarts stop, people are told the step and rank); a run
that passes the step cleanly makes it `transient` (the first reporting rank's node is named and
gets a compute self-test). The verdict is a pure function; the ledger is driven through a real
action log with Prometheus answers given at the query boundary. The bridge telling people or
testing a node through a real sidecar: tests/integration/test_bridge_nan_verdict.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from robust_metrics.bridge.config import parse
from robust_metrics.bridge.ledger import Entry, Ledger
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.nan_verdict import NanEvidence, first_report, nan_verdict
from robust_metrics.bridge.policy import AlertFacts, History, decide
from robust_metrics.bridge.store import ActionStore, NewAlert
from tests.bridge_fakes import run_incident

T0 = 1767225600.0
START = "2026-01-01T00:00:00Z"
# the labels name the rank that alerted first in Alertmanager's group, not necessarily the one
# that reported first; the ledger reads that from Prometheus
LABELS = {"alertname": "NonFiniteLoss", "action": "restart", "run": "r1", "rank": "0"}


# ---------------------------------------------------------------- pure parts
@pytest.mark.parametrize(("evidence", "verdict"), [
    (NanEvidence(120, "1", 120, 125), "persistent"),
    (NanEvidence(120, "1", None, 122), "transient"),
    (NanEvidence(120, "1", 130, 131), "transient"),  # passed 120 cleanly, a new NaN later
    (NanEvidence(120, "1", 110, 115), "recurred_elsewhere"),
    (NanEvidence(120, "1", None, 121), None),  # 121: the value of 120 may still be unread
    (NanEvidence(120, "1", None, None), None),
    (NanEvidence(None, None, None, 500), None),
])
def test_the_verdict(evidence: NanEvidence, verdict: str | None) -> None:
    assert nan_verdict(evidence) == verdict


def test_the_first_report_is_the_lowest_step_then_the_lowest_rank() -> None:
    assert first_report({"3": 120, "1": 121, "10": 120}) == ("3", 120)
    assert first_report({}) is None


def _config(**incidents: Any) -> Any:
    return parse({"auth": {"bearer_token": "t"},
                  "schedulers": {"ops": {"type": "webhook", "url": "http://127.0.0.1:1"}},
                  "incidents": {"poll": "1s", **incidents},
                  "rules": [{"name": "nan", "match": {"action": "restart"},
                             "actions": [{"type": "restart", "checkpoint_first": True}]}]})


def test_a_persistent_finding_turns_the_next_nan_restart_into_a_notify() -> None:
    finding = "the non-finite value came back at step 120 (first on rank 1)"
    plan = decide(_config(), AlertFacts(LABELS, START), History(persistent_nan=finding),
                  T0).plan
    assert [s["type"] for s in plan] == ["checkpoint", "notify"]
    assert plan[0]["skip"] == finding
    assert plan[1]["guard"] == "nan_persistent" and "step 120" in plan[1]["options"]["message"]
    other = AlertFacts({**LABELS, "alertname": "TrainingHang"}, START)
    assert [s["type"] for s in decide(_config(), other, History(persistent_nan=finding),
                                      T0).plan] == ["restart"]  # a hang: no checkpoint either
    assert [s["type"] for s in decide(_config(), AlertFacts(LABELS, START), History(),
                                      T0).plan] == ["checkpoint", "restart"]


# ---------------------------------------------------------------- the ledger
class FakePrometheus:
    """Answers the ledger's queries as Prometheus would for a run that hit a NaN at step 120 on
    rank 1 (node n2) and was restarted from step 100 at `acted`."""

    def __init__(self, acted: float) -> None:
        self.acted = acted
        self.recurred: float | None = None
        self.step_after = 110.0
        self.loss_ranks = True

    def __call__(self, promql: str, at: float | None) -> list[dict[str, Any]]:
        def value(v: float, **metric: str) -> dict[str, Any]:
            return {"metric": metric, "value": [at, str(v)]}

        if promql.startswith("min by (rank) (robust_nonfinite_first_step"):
            assert at is not None and at < self.acted  # read as it was before the restart
            if "robust_nonfinite_loss_steps_total" in promql:  # the ranks with a NaN loss
                return [value(120, rank="1")] if self.loss_ranks else []
            return [value(120, rank="0"), value(120, rank="1")]  # gradients: every rank
        if promql.startswith("max by (node) (robust_rank_info"):
            return [value(1, node="n2" if 'rank="1"' in promql else "n1")]
        if promql.startswith("max(robust_nonfinite_first_batch"):
            assert at is not None and at < self.acted
            return [value(1920)] if 'rank="1"' in promql else []  # rank 1's batch position
        if promql.startswith("min(robust_nonfinite_first_step"):
            assert "increase(robust_nonfinite_loss_steps_total" in promql
            return [] if self.recurred is None else [value(self.recurred, rank="1")]
        if promql.startswith("max(robust_global_step"):
            assert f"> {self.acted:.3f}" in promql  # only processes that stepped since
            return [value(self.step_after)]
        if promql.startswith("max(label_replace(robust_last_step_timestamp_seconds"):
            return [{"metric": {}, "values": [[self.acted + 5, str(self.acted + 4)]]}]
        if promql.startswith("min(label_replace((robust_start_step"):
            return [{"metric": {}, "values": [[self.acted + 5, "100"]]}]
        if promql.startswith("max(label_replace"):  # highest step before the restart
            return [value(121)]
        raise AssertionError(f"unexpected query {promql}")


def _restarted_incident(store: ActionStore, config: Any) -> float:
    """A NonFiniteLoss incident whose restart succeeded; returns when it acted."""
    return run_incident(
        store, config, NewAlert("f1", START, "r1", "NonFiniteLoss", LABELS, {}, "nan", [], T0), T0)


def _ledger(tmp_path: Path) -> tuple[Ledger, FakePrometheus, list[Entry]]:
    config = _config(recover_timeout="1h")
    store = ActionStore(str(tmp_path / "log.db"))
    acted = _restarted_incident(store, config)
    prom = FakePrometheus(acted)
    ledger = Ledger(config, store, BridgeMetrics(), prom)
    called: list[Entry] = []

    def on_verdict(entry: Entry) -> dict[str, Any]:
        called.append(entry)
        if entry.numerics["verdict"] == "transient":
            return {"selftest": {"n2": {"verdict": "fail", "failed": ["compute"],
                                        "detail": "digests differ", "drained": False}}}
        return {"notified": "sent"}

    ledger.on_nan_verdict = on_verdict
    return ledger, prom, called


def test_a_nan_at_the_same_step_after_the_restart_is_persistent(tmp_path: Path) -> None:
    ledger, prom, called = _ledger(tmp_path)
    assert ledger.step(now=T0 + 30) == []  # the run is at step 110: not there yet
    assert ledger.entries()[0].final is False and ledger.persistent_nan("r1") is None
    prom.recurred, prom.step_after = 120.0, 121.0
    (entry,) = ledger.step(now=T0 + 60)
    assert entry.numerics == {"verdict": "persistent", "step": 120.0, "rank": "1", "node": "n2",
                              "batch": 1920.0, "recurred_step": 120.0, "notified": "sent"}
    assert "persistent at step 120, first on rank 1 (node n2), batch 1920" in entry.note
    assert "restarts stopped" in entry.note
    assert entry.nodes == []  # the data or the model: no node is blamed
    assert ledger.persistent_nan("r1") == ("the non-finite value came back at step 120 (first "
                                           "on rank 1) after a restart from a checkpoint")
    assert len(called) == 1 and ledger.step(now=T0 + 90) == [] and len(called) == 1
    assert ledger.entries()[0] == entry  # stored as entered
    # a bridge that restarts keeps the finding (the engine reads it at the next decision)
    again = Ledger(ledger.config, ledger.store, BridgeMetrics(), prom)
    assert again.persistent_nan("r1") == ledger.persistent_nan("r1")


def test_a_run_that_passes_the_step_cleanly_makes_it_transient(tmp_path: Path) -> None:
    ledger, prom, called = _ledger(tmp_path)
    prom.step_after = 121.0
    assert ledger.step(now=T0 + 30) == []  # 121: the NaN of 120 could still be unread
    prom.step_after = 122.0
    (entry,) = ledger.step(now=T0 + 60)
    assert entry.numerics["verdict"] == "transient" and entry.numerics["node"] == "n2"
    assert "n2" in entry.nodes  # the suspect mark: the node counts in the node score
    assert entry.selftest["n2"]["failed"] == ["compute"]
    assert ledger.persistent_nan("r1") is None
    assert ledger.node_counts(T0 + 60) == {"n2": 1}
    assert len(called) == 1


def test_without_a_non_finite_loss_the_lowest_rank_with_the_step_is_first(
        tmp_path: Path) -> None:
    ledger, prom, _ = _ledger(tmp_path)
    prom.loss_ranks, prom.step_after = False, 122.0
    (entry,) = ledger.step(now=T0 + 60)
    assert (entry.numerics["rank"], entry.numerics["step"]) == ("0", 120.0)
    assert entry.numerics["node"] == "n1" and entry.numerics["batch"] is None


def test_a_run_that_never_gets_back_to_the_step_is_undecided(tmp_path: Path) -> None:
    ledger, _, called = _ledger(tmp_path)
    (entry,) = ledger.step(now=T0 + 3 + 3601)
    assert entry.numerics["verdict"] == "undecided" and called == []


# ---------------------------------------------------------------- before the verdict
PENDING = ("the verdict on the non-finite value of incident 1 (NonFiniteLoss) is awaited: the "
           "run has not met its step again since that restart; another restart would only "
           "replay it")


def test_a_nan_restart_waits_for_the_verdict_on_the_last_one() -> None:
    plan = decide(_config(), AlertFacts(LABELS, START), History(nan_pending=PENDING), T0).plan
    assert [(s.kind, s.skip, s.guard) for s in plan] == [
        ("checkpoint", PENDING, None), ("restart", PENDING, "nan_pending")]
    hang = AlertFacts({**LABELS, "alertname": "TrainingHang"}, START)
    assert [s.skip for s in decide(_config(), hang, History(nan_pending=PENDING), T0).plan] == [
        None]  # another alert's restart goes ahead


def _second_nan(ledger: Ledger, now: float) -> Any:
    """A new NonFiniteLoss instance of the run (as when the alert resolved while the ranks
    restarted and fired again as they came back), decided by the engine as a worker does."""
    from robust_metrics.bridge.actions import Actions
    from robust_metrics.bridge.engine import Engine

    store, config = ledger.store, ledger.config
    metrics = BridgeMetrics()
    engine = Engine(config, store, Actions(config, None, {}, metrics), metrics)  # type: ignore[arg-type]
    engine.nan_finding, engine.nan_pending = ledger.persistent_nan, ledger.pending_nan
    fingerprint = f"f{now}"
    plan = decide(config, AlertFacts(LABELS, START), History(), now).plan  # as on arrival
    store.accept([NewAlert(fingerprint, START, "r1", "NonFiniteLoss", LABELS, {}, "nan", plan,
                           T0)], now=now)
    claimed = store.claim(engine._decide, 3600, now=now)  # inside the claim's transaction
    assert claimed is not None and claimed[0].fingerprint == fingerprint
    store.finish_incident(claimed[0].id, "done", now=now)  # its steps are not the point here
    return claimed[1]


def test_a_nan_alert_that_fires_again_before_the_verdict_does_not_restart_again(
        tmp_path: Path) -> None:
    ledger, prom, _ = _ledger(tmp_path)  # restarted at T0 + 3; no ledger pass yet
    first = _second_nan(ledger, T0 + 3.8)
    assert [(s.kind, s.skip) for s in first.plan] == [("checkpoint", PENDING),
                                                       ("restart", PENDING)]
    assert ledger.pending_nan("r1", 99, T0 + 3.8) == PENDING
    # the run meets step 120 again: persistent; the next instance is a notify, not a restart
    prom.recurred, prom.step_after = 120.0, 121.0
    entries = {e.incident_id: e for e in ledger.step(now=T0 + 60)}
    assert entries[1].numerics["verdict"] == "persistent"
    assert entries[2].outcome == "no_restart"  # the skipped one: entered, nothing to judge
    assert ledger.pending_nan("r1", 99, T0 + 61) is None
    assert [s.kind for s in _second_nan(ledger, T0 + 61).plan] == ["checkpoint", "notify"]


def test_the_wait_ends_with_any_final_entry_or_the_recover_timeout(tmp_path: Path) -> None:
    ledger, prom, _ = _ledger(tmp_path)
    assert ledger.pending_nan("r1", 99, T0 + 3 + 3599) == PENDING
    assert ledger.pending_nan("r1", 99, T0 + 3 + 3601) is None  # no verdict will come now
    assert ledger.pending_nan("r2", 99, T0 + 10) is None  # another run
    prom.step_after = 122.0  # passed the step cleanly: transient, final
    ledger.step(now=T0 + 60)
    assert ledger.pending_nan("r1", 99, T0 + 61) is None
    decision = _second_nan(ledger, T0 + 62)
    assert [(s.kind, s.skip) for s in decision.plan] == [("checkpoint", None), ("restart", None)]
    blind = Ledger(ledger.config, ledger.store, BridgeMetrics(), None)  # no Prometheus
    assert blind.pending_nan("r1", 99, T0 + 5) is None
