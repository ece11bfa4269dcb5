"""The decided plan as typed steps: the same plans as before, the same stored form, rows written
before the type existed still load and resume, and every action name meets its code in one table."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from robust_metrics.bridge import config
from robust_metrics.bridge.actions import HANDLERS, Actions, StepContext
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.plan import PlanStep, dump_plan, load_plan
from robust_metrics.bridge.policy import AlertFacts, History, decide
from robust_metrics.bridge.store import ActionStore, Incident

T0 = 1767225600.0
START = "2026-01-01T00:00:00Z"
BUDGET = "restart budget exhausted: 1 restarts of run r1 in the last 3600s (limit 1)"
LOOP = "crash loop: the highest step (7) has not advanced over the last 2 restarts"
NAN = "the non-finite value came back at step 120"
CHECKPOINT = {"type": "checkpoint", "continue_on_error": True,
              "options": {"timeout_s": 120.0, "at_step": None, "before_restart": True},
              "dry_run": False}
RESTART_OPTIONS = {"scheduler": "ops", "checkpoint_first": True, "require_checkpoint": False,
                   "checkpoint_timeout_s": 120.0, "notice_timeout_s": 60.0}
NOTIFY = {"type": "notify", "continue_on_error": False, "options": {"message": None},
          "dry_run": False}
# What the bridge wrote into the action log before its plans were typed (its policy's output for
# these histories, as JSON), every marker included.
WRITTEN_BEFORE: dict[str, list[dict[str, Any]]] = {
    "highest step": [CHECKPOINT, {"type": "restart", "continue_on_error": False,
                                  "options": RESTART_OPTIONS, "dry_run": False,
                                  "highest_step": 12.0}, NOTIFY],
    "budget": [{**CHECKPOINT, "skip": BUDGET}, {
        "type": "notify", "continue_on_error": False, "dry_run": False,
        "escalated_from": "restart", "options": {
            "message": f"{BUDGET}; escalating instead of restarting (NonFiniteLoss)"}}, NOTIFY],
    "crash loop": [{**CHECKPOINT, "skip": LOOP}, {
        "type": "notify", "continue_on_error": False, "dry_run": False,
        "escalated_from": "restart", "guard": "crash_loop", "options": {
            "message": f"run r1: {LOOP}; not restarting it again (NonFiniteLoss); the job "
                       "itself is likely at fault"}}, NOTIFY],
    "persistent NaN": [{**CHECKPOINT, "skip": NAN}, {
        "type": "notify", "continue_on_error": False, "dry_run": False,
        "escalated_from": "restart", "guard": "nan_persistent", "options": {
            "message": f"run r1: {NAN}; not restarting it again (NonFiniteLoss): the data or "
                       "the model is at fault"}}, NOTIFY],
    "over-eviction": [
        {"type": "dump_stacks", "continue_on_error": False, "options": {}, "dry_run": False},
        {"type": "drain_node", "continue_on_error": False, "options": {"scheduler": "ops"},
         "over_evict": True, "dry_run": False},
        {"type": "restart", "continue_on_error": False,
         "options": {**RESTART_OPTIONS, "checkpoint_first": False}, "dry_run": False}],
}
NAN_FACTS = AlertFacts({"alertname": "NonFiniteLoss", "run": "r1", "action": "restart"}, START)
HISTORIES: dict[str, tuple[AlertFacts, History, float]] = {
    "highest step": (NAN_FACTS, History(highest_step=12.0), T0),
    "budget": (NAN_FACTS, History(restarts=(T0 - 1,)), T0),
    "crash loop": (NAN_FACTS, History(restarts=(T0 - 100, T0 - 50), restart_steps=(7.0, 7.0),
                                      highest_step=7.0), T0 + 100000),
    "persistent NaN": (NAN_FACTS, History(persistent_nan=NAN), T0),
    "over-eviction": (AlertFacts({"alertname": "TrainingHang", "run": "r1"}, START), History(),
                      T0),
}


def _config() -> config.BridgeConfig:
    return parse({
        "auth": {"bearer_token": "t"}, "schedulers": {"ops": {"type": "webhook",
                                                               "url": "http://h"}},
        "notify": {"url": "http://n"},
        "incidents": {"over_eviction": True, "crash_loop_restarts": 2},
        "restart_budget": {"max_restarts": 1},
        "rules": [{"name": "r", "match": {"action": "restart"},
                   "actions": [{"type": "restart", "checkpoint_first": True}, "notify"]},
                  {"name": "h", "match": {"alertname": "TrainingHang"},
                   "actions": ["drain_node", "restart"]}]})


@pytest.mark.parametrize("case", sorted(WRITTEN_BEFORE))
def test_the_policy_decides_the_plans_it_decided_before(case: str) -> None:
    facts, history, now = HISTORIES[case]
    plan = decide(_config(), facts, history, now).plan
    assert all(isinstance(s, PlanStep) for s in plan)
    assert dump_plan(plan) == WRITTEN_BEFORE[case]
    assert [dict(s) for s in plan] == WRITTEN_BEFORE[case]  # it reads as its stored form


@pytest.mark.parametrize("case", sorted(WRITTEN_BEFORE))
def test_a_plan_stored_before_loads_into_its_fields_and_back(case: str) -> None:
    stored = WRITTEN_BEFORE[case]
    plan = load_plan(json.loads(json.dumps(stored)))
    assert dump_plan(plan) == stored
    by_kind = {s.kind: s for s in plan}
    if case == "highest step":
        assert by_kind["restart"].highest_step == 12.0 and by_kind["checkpoint"].before_restart
    elif case == "over-eviction":
        assert by_kind["drain_node"].over_evict and not by_kind["restart"].over_evict
    else:
        assert plan[0].skip and plan[1].escalated_from == "restart"
        assert plan[1].guard == {"budget": None, "crash loop": "crash_loop",
                                 "persistent NaN": "nan_persistent"}[case]


def test_an_incident_row_written_before_resumes_with_its_typed_plan(tmp_path: Path) -> None:
    """A bridge upgraded while an incident was running picks its plan up from the old row."""
    path = str(tmp_path / "bridge.db")
    ActionStore(path).close()  # a log as the bridge creates it
    db = sqlite3.connect(path)
    db.execute("INSERT INTO incidents (key, fingerprint, starts_at, run, alertname, rule, labels, "
               "annotations, plan, status, not_before, received, started, updated) VALUES "
               "('f@s', 'f', ?, 'r1', 'NonFiniteLoss', 'r', '{}', '{}', ?, 'running', 0, 0, 1, 1)",
               (START, json.dumps(WRITTEN_BEFORE["crash loop"])))
    db.commit()
    db.close()
    store = ActionStore(path)
    try:
        assert store.recover({}) == []
        claimed = store.claim(lambda *a: pytest.fail("a started incident is not decided again"),
                              3600)
        assert claimed is not None
        incident, decision = claimed
        assert decision.verdict == "run" and decision.reason == "resumed"
        assert [s.kind for s in incident.plan] == ["checkpoint", "notify", "notify"]
        assert incident.plan[0].skip == LOOP and incident.plan[1].guard == "crash_loop"
        assert dump_plan(store.get(incident.id).plan) == WRITTEN_BEFORE["crash loop"]  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_step_is_a_frozen_value() -> None:
    step = PlanStep("restart", {"scheduler": "ops"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.skip = "no"  # type: ignore[misc]
    with pytest.raises(TypeError):
        step.options["scheduler"] = "other"  # type: ignore[index]
    assert dataclasses.replace(step, skip="why") == PlanStep("restart", {"scheduler": "ops"},
                                                             skip="why")
    with pytest.raises(ValueError, match="action name"):
        PlanStep.from_dict({"options": {}})


def test_every_action_has_its_handler_in_one_table() -> None:
    assert list(HANDLERS) == list(config.ACTIONS)
    for name, handler in HANDLERS.items():
        assert handler is getattr(Actions, f"_{name}")


def test_a_stored_step_of_an_unknown_action_fails_that_step() -> None:
    plan = [PlanStep("reboot")]
    incident = Incident(1, "f@s", "f", START, "r1", "A", "r", {}, {}, plan, "running", "", 0,
                        0, 0, 0, 1)
    runner = Actions(_config(), None, {}, BridgeMetrics())  # type: ignore[arg-type]
    outcome = runner.run(StepContext(incident, 0, plan[0], lambda _: None))
    assert outcome.status == "failed" and "unknown action 'reboot'" in outcome.detail
