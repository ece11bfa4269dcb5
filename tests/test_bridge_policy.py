"""`policy.decide`: what the bridge does for an alert, as a pure function of the alert, the policy
and the run's history in the action log. No network, no SQL, no clock: time is an argument."""

from __future__ import annotations

import copy
from typing import Any

from robust_metrics.bridge import policy
from robust_metrics.bridge.actions import Actions
from robust_metrics.bridge.config import ACTIONS, BridgeConfig, parse
from robust_metrics.bridge.policy import AlertFacts, History, decide
from robust_metrics.bridge.store import ActionStore, Incident, NewAlert

T0 = 1767225600.0  # 2026-01-01T00:00:00Z
START = "2026-01-01T00:00:00Z"


def config(**extra: Any) -> BridgeConfig:
    return parse({
        "auth": {"bearer_token": "t"},
        "schedulers": {"hook": {"type": "webhook", "url": "http://127.0.0.1:1"}},
        "notify": {"url": "http://127.0.0.1:1"},
        "restart_budget": {"max_restarts": 2, "window": "1h"},
        "rules": [
            {"name": "hang", "match": {"action": "restart"}, "cooldown_s": 600,
             "actions": ["dump_stacks", {"type": "restart", "checkpoint_first": True}]},
            {"name": "slow", "match": {"action": "checkpoint"}, "for": "2m",
             "actions": ["checkpoint"]},
        ], **extra})


def alert(action: str, alertname: str = "Straggler", **labels: str) -> AlertFacts:
    return AlertFacts({"alertname": alertname, "action": action, "run": "r1", **labels}, START)


def test_no_rule_means_ignore() -> None:
    d = decide(config(), alert("drain_node"), History(), T0)
    assert (d.verdict, d.rule, d.plan, d.reason) == ("ignore", None, [], "no rule matched")


def test_for_guard_waits_until_the_instance_has_fired_long_enough() -> None:
    cfg = config()
    early = decide(cfg, alert("checkpoint"), History(), T0 + 119)
    assert (early.verdict, early.rule, early.not_before) == ("wait", "slow", T0 + 120)
    due = decide(cfg, alert("checkpoint"), History(), T0 + 120)
    assert due.verdict == "run" and [s["type"] for s in due.plan] == ["checkpoint"]


def test_cooldown_skips_the_same_rule_on_the_same_run_only_within_it() -> None:
    cfg = config()
    recent = History(last_started={"hang": (7, T0 - 100)})
    d = decide(cfg, alert("restart"), recent, T0)
    assert d.verdict == "skip" and d.rule == "hang"
    assert d.reason == "cooldown: rule hang acted on run r1 100s ago (incident 7; cooldown 600s)"
    assert decide(cfg, alert("restart"), History(last_started={"hang": (7, T0 - 601)}),
                  T0).verdict == "run"
    assert decide(cfg, alert("restart"), History(last_started={"slow": (7, T0 - 1)}),
                  T0).verdict == "run"


def test_checkpoint_first_unless_the_job_is_hung() -> None:
    cfg = config()
    plan = decide(cfg, alert("restart"), History(), T0).plan
    assert [(s["type"], s["options"].get("before_restart")) for s in plan] == [
        ("dump_stacks", None), ("checkpoint", True), ("restart", None)]
    assert plan[2]["options"]["scheduler"] == "hook" and not any(s["dry_run"] for s in plan)
    for hung in (alert("restart", "RobustRankHang"), alert("restart", hung="true")):
        assert [s["type"] for s in decide(cfg, hung, History(), T0).plan] == [
            "dump_stacks", "restart"]


def test_restart_budget_escalates_and_skips_the_checkpoint_before_it() -> None:
    cfg = config()
    within = History(restarts=(T0 - 10, T0 - 3601))  # one in the window
    under = decide(cfg, alert("restart"), within, T0)
    assert [s["type"] for s in under.plan] == ["dump_stacks", "checkpoint", "restart"]
    assert not any(s.get("skip") for s in under.plan)
    over = decide(cfg, alert("restart"), History(restarts=(T0 - 10, T0 - 20, T0 - 4000)), T0)
    assert over.verdict == "run"
    stacks, checkpoint, escalation = over.plan
    assert stacks["type"] == "dump_stacks" and "skip" not in stacks
    why = "restart budget exhausted: 2 restarts of run r1 in the last 3600s (limit 2)"
    assert checkpoint["type"] == "checkpoint" and checkpoint["skip"] == why
    assert escalation["type"] == "notify" and escalation["escalated_from"] == "restart"
    assert escalation["options"]["message"] == (
        f"{why}; escalating instead of restarting (Straggler)")


def test_two_restarts_in_one_plan_each_use_the_budget() -> None:
    cfg = config(rules=[{"name": "twice", "match": {"action": "restart"},
                         "actions": ["restart", "restart", "restart"]}])
    plan = decide(cfg, alert("restart"), History(restarts=(T0 - 1,)), T0).plan
    assert [s["type"] for s in plan] == ["restart", "notify", "notify"]


def test_decide_is_pure() -> None:
    cfg = config()
    facts, log = alert("restart"), History(restarts=(T0 - 10, T0 - 20))
    before = copy.deepcopy((dict(facts.labels), list(log.restarts)))
    first = decide(cfg, facts, log, T0)
    assert decide(cfg, facts, log, T0) == first
    assert (dict(facts.labels), list(log.restarts)) == before
    first.plan.clear()  # a caller changing its plan changes no later decision
    assert decide(cfg, facts, log, T0).plan


def test_every_action_is_named_once_and_has_a_handler() -> None:
    assert ACTIONS == ("checkpoint", "dump_stacks", "selftest", "restart", "drain_node", "notify")
    assert all(callable(getattr(Actions, f"_{name}", None)) for name in ACTIONS)


def test_the_store_persists_the_decision_with_the_history_it_read(tmp_path: Any) -> None:
    store = ActionStore(str(tmp_path / "log.db"))
    seen: list[History] = []

    def decide_and_record(incident: Incident, history: History, now: float) -> policy.Decision:
        seen.append(history)
        return decide(config(), AlertFacts(incident.labels, incident.starts_at), history, now)

    try:
        labels = {"alertname": "Straggler", "action": "restart", "run": "r1"}
        plan = decide(config(), AlertFacts(labels, START), History(), T0).plan
        store.accept([NewAlert(f, START, "r1", "Straggler", labels, {}, "hang", plan, T0)
                      for f in ("a", "b")], now=T0)
        first, d1 = store.claim(decide_and_record, 3600, now=T0 + 1) or (None, None)
        assert d1 is not None and d1.verdict == "run" and first is not None
        assert store.claim(decide_and_record, 3600, now=T0 + 2) is None  # run r1 is busy
        store.finish_incident(first.id, "done", now=T0 + 3)
        second, d2 = store.claim(decide_and_record, 3600, now=T0 + 4) or (None, None)
        assert d2 is not None and d2.verdict == "skip" and "cooldown" in d2.reason
        assert seen[-1].last_started == {"hang": (first.id, T0 + 1)}
        stored = store.get(second.id) if second else None
        assert stored is not None and (stored.status, stored.reason) == ("skipped", d2.reason)
        assert store.get(first.id).plan == d1.plan  # type: ignore[union-attr]
    finally:
        store.close()
