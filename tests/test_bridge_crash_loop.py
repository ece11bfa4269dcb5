"""The crash-loop guard: a run whose highest step has not advanced over N restarts is not restarted
again; the bridge notifies with the reason and the ledger enters the incident as `crash_loop`.

In policy terms (pure, time and history as arguments), through the store (the evidence each
restart records is the history the next decision reads), and on real parts: a torchrun job that
crashes at the same step after every restart, the real sidecar and Prometheus, the bridge with
the `local` scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from robust_metrics.bridge.config import BridgeConfig, parse
from robust_metrics.bridge.policy import AlertFacts, History, crash_loop, decide
from robust_metrics.bridge.store import ActionStore, NewAlert

T0 = 1767225600.0  # 2026-01-01T00:00:00Z
START = "2026-01-01T00:00:00Z"


def config(n: int = 2, **extra: Any) -> BridgeConfig:
    return parse({
        "auth": {"bearer_token": "t"},
        "schedulers": {"hook": {"type": "webhook", "url": "http://127.0.0.1:1"}},
        "notify": {"url": "http://127.0.0.1:1"},
        "restart_budget": {"max_restarts": 10, "window": "1h"},
        "incidents": {"crash_loop_restarts": n},
        "rules": [{"name": "crash", "match": {"alertname": "RankExited"},
                   "actions": [{"type": "restart", "checkpoint_first": True}]}],
        **extra})


FACTS = AlertFacts({"alertname": "RankExited", "run": "r1", "rank": "1"}, START)


def types(plan: list[dict[str, Any]]) -> list[str]:
    return [s["type"] for s in plan]


def test_restarts_while_the_step_advances_and_records_the_evidence() -> None:
    d = decide(config(), FACTS, History(restarts=(T0 - 60, T0 - 30), restart_steps=(10, 20),
                                        highest_step=30), T0)
    assert types(d.plan) == ["checkpoint", "restart"] and d.plan[1]["highest_step"] == 30
    # one restart without progress is not yet N=2
    one = decide(config(), FACTS, History(restarts=(T0 - 60, T0 - 30), restart_steps=(10, 30),
                                          highest_step=30), T0)
    assert types(one.plan) == ["checkpoint", "restart"]


def test_n_restarts_without_progress_notify_instead_with_the_reason() -> None:
    log = History(restarts=(T0 - 90, T0 - 60, T0 - 30), restart_steps=(5, 7, 7), highest_step=7)
    assert crash_loop(config(), log) == (
        "crash loop: the highest step (7) has not advanced over the last 2 restarts")
    d = decide(config(), FACTS, log, T0)
    assert d.verdict == "run"
    checkpoint, notify = d.plan
    assert checkpoint["skip"].startswith("crash loop") and notify["type"] == "notify"
    assert notify["guard"] == "crash_loop" and notify["escalated_from"] == "restart"
    assert notify["options"]["message"] == (
        "run r1: crash loop: the highest step (7) has not advanced over the last 2 restarts; "
        "not restarting it again (RankExited); the job itself is likely at fault")


def test_unknown_steps_off_and_fewer_restarts_keep_restarting() -> None:
    stuck = History(restarts=(T0 - 60, T0 - 30), restart_steps=(7, 7), highest_step=7)
    assert crash_loop(config(n=0), stuck) is None  # guard off
    assert crash_loop(config(n=3), stuck) is None  # only 2 restarts so far
    assert crash_loop(config(), History(restarts=stuck.restarts, restart_steps=(7, 7))) is None
    assert crash_loop(config(), History(restarts=stuck.restarts, restart_steps=(None, 7),
                                        highest_step=7)) is None
    assert types(decide(config(n=0), FACTS, stuck, T0).plan) == ["checkpoint", "restart"]


def test_the_store_hands_each_recorded_step_to_the_next_decision(tmp_path: Path) -> None:
    store = ActionStore(str(tmp_path / "log.db"))
    cfg = config()
    seen: list[History] = []
    try:
        for n in range(3):
            fp = f"f{n}"
            store.accept([NewAlert(fp, START, "r1", "RankExited", dict(FACTS.labels), {},
                                   "crash", [], T0)], now=T0 + 10 * n)

            def decide_at_7(incident: Any, history: History, now: float) -> Any:
                history = History(history.last_started, history.restarts,
                                  history.restart_steps, 7.0)
                seen.append(history)
                return decide(cfg, AlertFacts(incident.labels, incident.starts_at), history, now)

            claimed = store.claim(decide_at_7, 3600, now=T0 + 10 * n + 1)
            assert claimed is not None
            incident, decision = claimed
            for idx, step in enumerate(decision.plan):
                store.start_step(incident.id, idx, step["type"], now=T0 + 10 * n + 2)
                data = {"highest_step": step.get("highest_step")}
                store.finish_step(incident.id, idx, "success", "ok", data, now=T0 + 10 * n + 3)
            store.finish_incident(incident.id, "done", now=T0 + 10 * n + 4)
        assert [list(h.restart_steps) for h in seen] == [[], [7.0], [7.0, 7.0]]
        assert types(decide(cfg, FACTS, seen[-1], T0 + 30).plan) == ["checkpoint", "notify"]
    finally:
        store.close()
