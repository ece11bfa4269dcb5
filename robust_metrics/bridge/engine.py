"""Runs accepted incidents through their plan, one step at a time, on a few worker threads.

The webhook only records alerts (fast, durable); the engine claims due incidents from the store,
which decides them with `policy.decide` in the claiming transaction (guard, cooldown, restart
budget), and executes the decided plan's steps, each committed as `running` before its side
effect. Incidents of one run never run concurrently.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from robust_metrics.bridge import policy
from robust_metrics.bridge.actions import Actions, Interrupted, Outcome, StepContext
from robust_metrics.bridge.config import ACTIONS, BridgeConfig
from robust_metrics.bridge.ledger import highest_step
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.plan import PlanStep
from robust_metrics.bridge.store import ActionStore, Incident, Step

__all__ = ["Engine"]

log = logging.getLogger(__name__)


class Engine:
    """Worker threads that drain the action log."""

    def __init__(self, config: BridgeConfig, store: ActionStore, actions: Actions,
                 metrics: BridgeMetrics) -> None:
        self.config = config
        self.store = store
        self.actions = actions
        self.metrics = metrics
        self.stop_event = actions.stop
        self._wake = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._horizon_s = policy.history_horizon_s(config)
        # run -> the ledger's finding that its non-finite value persists (set by the service)
        self.nan_finding: Callable[[str], str | None] | None = None
        # (run, incident id, now) -> why the verdict on an earlier NaN restart of the run is
        # awaited (set by the service)
        self.nan_pending: Callable[[str, int, float], str | None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def recover(self) -> list[str]:
        """Settle what a previous bridge process left running (call before `start`)."""
        checks = {
            action: (lambda step, _a=action: self.actions.resumable(
                step, self.store.get(step.incident_id)))
            for action in ACTIONS
        }
        notes = self.store.recover(checks)
        for note in notes:
            log.warning("recovery: %s", note)
        return notes

    def start(self) -> None:
        for n in range(self.config.workers):
            t = threading.Thread(target=self._loop, name=f"bridge-worker-{n}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_event.set()
        self.wake()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                claimed = self.store.claim(self._decide, self._horizon_s)
            except Exception:
                log.exception("claiming an incident failed")
                claimed = None
            if claimed is not None:
                incident, decision = claimed
                if decision.verdict == "run":
                    try:
                        self.process(incident)
                    except Interrupted:
                        return
                    except Exception:
                        log.exception("incident %s failed in the engine", incident.key)
                        self.store.finish_incident(incident.id, "failed",
                                                   "internal error; see log")
                elif decision.verdict == "skip":
                    for spec in decision.plan:
                        self.metrics.action(incident.run, spec.kind, "skipped", None)
                    log.info("incident %s skipped: %s", incident.key, decision.reason)
                self.wake()  # another run's incident may now be claimable
                continue
            due = self.store.next_due()
            wait = 1.0 if due is None else min(1.0, max(0.02, due - time.time()))
            with self._wake:
                self._wake.wait(wait)

    # ------------------------------------------------------------------ one incident
    def _decide(self, incident: Incident, history: policy.History,
                now: float) -> policy.Decision:
        if any(step.kind == "restart" for step in incident.plan):
            history = dataclasses.replace(history, highest_step=self._highest_step(incident.run))
            if self.nan_finding is not None:
                history = dataclasses.replace(history,
                                              persistent_nan=self.nan_finding(incident.run))
            if self.nan_pending is not None:
                history = dataclasses.replace(history, nan_pending=self.nan_pending(
                    incident.run, incident.id, now))
        return policy.decide(self.config, policy.AlertFacts(incident.labels, incident.starts_at),
                             history, now)

    def _highest_step(self, run: str) -> float | None:
        """The run's highest step now (the crash-loop guard's evidence); None when unknown."""
        prometheus = self.actions.prometheus
        if self.config.incidents.crash_loop_restarts <= 0 or prometheus is None:
            return None
        try:
            return highest_step(prometheus.query, run, self.config.incidents.lookback_s)
        except Exception as exc:  # no evidence: the guard stays open, the budget still holds
            log.warning("highest step of run %s unknown: %s", run, exc)
            return None

    def process(self, incident: Incident) -> None:
        """Run (or resume) a claimed incident's plan to its end."""
        plan = list(incident.plan)
        steps = self.store.steps(incident.id)
        idx = 0
        if steps:
            last = steps[-1]
            idx = last.idx + 1
            if last.status == "running":
                if not self._finish(incident, plan, last.idx, self._run_step(
                        incident, plan[last.idx], last.idx, last, resumed=True)):
                    return
                if idx >= len(plan):
                    return  # _finish closed the incident with its last step
            elif last.status == "failed" and not plan[last.idx].continue_on_error:
                self.store.finish_incident(incident.id, "failed",
                                           f"step {last.idx} ({last.action}): {last.detail}")
                return
        if idx >= len(plan):  # every step had finished before a restart of the bridge
            self.store.finish_incident(incident.id, "done")
        while idx < len(plan):
            spec = plan[idx]
            if spec.escalated_from:  # the restart the budget turned into a notify
                self.metrics.action(incident.run, spec.escalated_from, "skipped", None)
            self.store.start_step(incident.id, idx, spec.kind)
            if not self._finish(incident, plan, idx,
                                self._run_step(incident, spec, idx, None, resumed=False)):
                return
            idx += 1

    def _run_step(self, incident: Incident, spec: PlanStep, idx: int,
                  step: Step | None, *, resumed: bool) -> tuple[Outcome, float]:
        t0 = time.monotonic()
        if spec.skip:  # decided by the policy (the restart after it is over budget)
            return Outcome("skipped", spec.skip), 0.0

        def save(data: Mapping[str, Any]) -> None:
            self.store.save_step_data(incident.id, idx, data)

        earlier = [s for s in self.store.steps(incident.id) if s.idx < idx]
        ctx = StepContext(incident, idx, spec, save, dict(step.data) if step else {},
                          resumed, earlier)
        outcome = self.actions.run(ctx)
        return outcome, time.monotonic() - t0

    def _finish(self, incident: Incident, plan: list[PlanStep], idx: int,
                result: tuple[Outcome, float]) -> bool:
        """Record the step; False when the chain stops here."""
        outcome, seconds = result
        spec = plan[idx]
        action = spec.kind
        stops = outcome.status == "failed" and not spec.continue_on_error
        closing = "failed" if stops else "done" if idx == len(plan) - 1 else None
        self.store.finish_step(incident.id, idx, outcome.status, outcome.detail, outcome.data,
                               incident_status=closing,
                               incident_reason=f"step {idx} ({action}): {outcome.detail}"
                               if stops else "")
        self.metrics.action(incident.run, action, outcome.status, seconds)
        log.info("incident %s step %d %s: %s (%s)", incident.key, idx, action, outcome.status,
                 outcome.detail)
        return not stops
