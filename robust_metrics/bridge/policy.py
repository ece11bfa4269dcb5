"""What the bridge will do for an alert: one pure function, `decide(config, alert, log, now)`.

Everything that turns an alert into actions is here, as a function of the alert, the policy and
what the action log says about the alert's run, with no HTTP, SQL or clock inside, so it reads
(and is tested) like Alertmanager's routing. In order:

1. **match**: the first rule, in file order, whose `match` and `match_re` accept the labels;
   none: `ignore`.
2. **plan**: the rule's chain with defaults filled in. `restart` with `checkpoint_first` gets a
   checkpoint step before it, unless the alert says the job is hung (a hung rank cannot write a
   checkpoint, so asking would only add the checkpoint timeout to the outage). With
   `incidents.over_eviction`, a `drain_node` of a hung run without a `node` label drains the
   nodes of the stack analysis' suspects (`eviction_nodes`): it is marked `over_evict` and gets
   a `dump_stacks` step before it when the chain has none.
3. **guard**: the instance acts only once it has fired for the rule's `for` (startsAt + for_s):
   before that, `wait` (a resolution that arrives meanwhile cancels it).
4. **cooldown**: when the same rule started acting on the same run within `cooldown_s`: `skip`.
5. **budget**: a restart past `restart_budget` restarts of the run within the window becomes a
   `notify` escalation, and the checkpoint asked for before it is skipped.
6. **crash loop**: when the run's highest step has not advanced over the last
   `incidents.crash_loop_restarts` restarts (each restart step records the highest step seen
   before it), a further restart would replay the same failure (a bug in the job, not a machine):
   it becomes a `notify` escalation that says so, marked `guard: crash_loop` for the ledger.
7. **persistent non-finite values**: when the ledger has found that a run's non-finite value came
   back at the same step after a restart (`bridge.numerics`), a restart for another alert of
   non-finite values (`incidents.nan_alert_re`) would replay it: it becomes a `notify` that
   names the step and rank, marked `guard: nan_persistent`.
8. **pending non-finite verdict**: while the run has been restarted for a non-finite value and
   the ledger has not yet judged it (the run has not met the bad step again), a restart for
   another such alert is skipped, marked `guard: nan_pending`. The alert is the same value
   seen again (an alert that resolved while the ranks restarted and fired again when they came
   back, with a new startsAt) or its recurrence, which the ledger is about to judge: another
   restart could only replay it before the verdict, and the verdict itself tells people or
   tests the node.

The bridge calls `decide` when an alert arrives (to record its rule, plan and due time) and again
when a worker claims it, inside the store's transaction, with the run's history read in that
transaction; the store only persists the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from robust_metrics.bridge.config import BridgeConfig, Rule
from robust_metrics.bridge.payload import parse_time
from robust_metrics.bridge.plan import PlanStep

__all__ = ["AlertFacts", "Decision", "History", "build_plan", "crash_loop", "decide",
           "eviction_nodes", "history_horizon_s",
           "is_hang", "match_rule", "not_before", "parse_time"]

Verdict = Literal["ignore", "wait", "skip", "run"]


@dataclass(frozen=True)
class AlertFacts:
    """The parts of a firing alert instance a decision reads."""

    labels: Mapping[str, str]
    starts_at: str


@dataclass(frozen=True)
class History:
    """What the action log says about one run, all a decision needs from it.

    `last_started`: per rule, when another instance of it last started acting on the run (and
    that incident's id); `restarts`: when restart steps of the run started (every status but
    `skipped` counts: failed and dry-run restarts use the budget too).
    """

    last_started: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    restarts: Sequence[float] = ()
    restart_steps: Sequence[float | None] = ()
    highest_step: float | None = None
    persistent_nan: str | None = None  # the ledger's finding, when the run has one
    nan_pending: str | None = None  # why the ledger's verdict on an earlier NaN restart is awaited


@dataclass(frozen=True)
class Decision:
    """The verdict on an alert instance, the rule that matched, and the plan decided for it."""

    verdict: Verdict
    rule: str | None
    plan: list[PlanStep]
    not_before: float
    reason: str = ""


def match_rule(config: BridgeConfig, labels: Mapping[str, str]) -> Rule | None:
    """The first rule, in file order, whose match and match_re accept the labels."""
    for rule in config.rules:
        if rule.matches(labels):
            return rule
    return None


def not_before(rule: Rule, starts_at: str) -> float:
    return parse_time(starts_at).timestamp() + rule.for_s


def is_hang(config: BridgeConfig, labels: Mapping[str, str]) -> bool:
    return (labels.get("hung", "").lower() == "true"
            or bool(config.hang_alert_re.fullmatch(labels.get("alertname", ""))))


def build_plan(config: BridgeConfig, rule: Rule, labels: Mapping[str, str]) -> list[PlanStep]:
    """The rule's chain with defaults filled in: each step names its scheduler and dry-run mode."""
    hung = is_hang(config, labels)
    dry = config.dry_run or rule.dry_run
    plan: list[PlanStep] = []
    for spec in rule.actions:
        options = dict(spec.options)
        if spec.type in ("restart", "drain_node"):
            options["scheduler"] = options.get("scheduler") or rule.scheduler
        if spec.type == "restart" and options.get("checkpoint_first") and not hung:
            plan.append(PlanStep(
                "checkpoint", {"timeout_s": options.get("checkpoint_timeout_s", 120.0),
                               "at_step": None, "before_restart": True},
                continue_on_error=not options.get("require_checkpoint", False), dry_run=dry))
        plan.append(PlanStep(spec.type, options, spec.continue_on_error, dry_run=dry))
    if config.incidents.over_eviction and hung and not labels.get("node"):
        plan = _over_evict(plan, dry)
    return plan


def _over_evict(plan: list[PlanStep], dry: bool) -> list[PlanStep]:
    """Drain steps take their nodes from the suspects of a stack dump taken before them."""
    out: list[PlanStep] = []
    dumped = False
    for step in plan:
        if step.kind == "dump_stacks":
            dumped = True
        if step.kind == "drain_node":
            if not dumped:
                out.append(PlanStep("dump_stacks", dry_run=dry))
                dumped = True
            step = replace(step, over_evict=True)
        out.append(step)
    return out


def _escalation(step: PlanStep, message: str, guard: str | None = None) -> PlanStep:
    """The notify that replaces a refused step (a restart past the budget or a guard)."""
    return PlanStep("notify", {"message": message}, dry_run=step.dry_run,
                    escalated_from=step.kind, guard=guard)


def eviction_nodes(suspects: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """The smallest set of nodes that holds every suspect rank, and the suspects no node is
    known for.

    A hang that cannot be pinned on one rank names several (a pipeline group waiting on each
    other, say); draining only one of their nodes would leave the culprit in the job half the
    time. Each rank runs on exactly one node, so the smallest cover is the set of their nodes.
    """
    nodes: set[str] = set()
    unplaced: list[str] = []
    for suspect in suspects:
        node = suspect.get("node")
        if node:
            nodes.add(str(node))
        else:
            unplaced.append(str(suspect.get("rank", "?")))
    return sorted(nodes), unplaced


def history_horizon_s(config: BridgeConfig) -> float:
    """How far back a decision looks into the log (the longest cooldown or budget window)."""
    return max([config.restart_window_s, *(r.cooldown_s for r in config.rules)])


def _cooldown(rule: Rule, run: str, log: History, now: float) -> str | None:
    last = log.last_started.get(rule.name)
    if rule.cooldown_s <= 0 or last is None or last[1] < now - rule.cooldown_s:
        return None
    return (f"cooldown: rule {rule.name} acted on run {run} {now - last[1]:.0f}s ago "
            f"(incident {last[0]}; cooldown {rule.cooldown_s:.0f}s)")


def _before_restart(step: PlanStep) -> bool:
    return step.kind == "checkpoint" and step.before_restart


def _budget(config: BridgeConfig, plan: list[PlanStep], run: str, alertname: str,
            log: History, now: float) -> list[PlanStep]:
    """Restarts past the budget become notify escalations; their checkpoint is skipped."""
    window = config.restart_window_s
    used = sum(1 for t in log.restarts if t >= now - window)
    out: list[PlanStep] = []
    for step in plan:
        if step.kind != "restart" and not _before_restart(step):
            out.append(step)
            continue
        if used < config.restart_budget:
            if step.kind == "restart":
                used += 1
            out.append(step)
            continue
        why = (f"restart budget exhausted: {used} restarts of run {run} in the last "
               f"{window:.0f}s (limit {config.restart_budget})")
        if _before_restart(step):
            out.append(replace(step, skip=why))
        else:
            out.append(_escalation(step, f"{why}; escalating instead of restarting "
                                         f"({alertname})"))
    return out


def crash_loop(config: BridgeConfig, log: History) -> str | None:
    """Why the run is in a crash loop (highest step unchanged over the last N restarts), or None."""
    n = config.incidents.crash_loop_restarts
    if n <= 0 or log.highest_step is None or len(log.restart_steps) < n:
        return None
    recent = list(log.restart_steps)[-n:]
    if any(s is None or s != log.highest_step for s in recent):
        return None
    return (f"crash loop: the highest step ({log.highest_step:.0f}) has not advanced over the "
            f"last {n} restarts")


def _crash_loop_guard(config: BridgeConfig, plan: list[PlanStep], run: str,
                      alertname: str, log: History) -> list[PlanStep]:
    """Restarts of a run in a crash loop become notify escalations; each restart that stays
    records the highest step it saw, the evidence the next decision reads."""
    why = crash_loop(config, log)
    out: list[PlanStep] = []
    for step in plan:
        if step.kind != "restart":
            out.append(step)
        elif why is None:
            out.append(step if log.highest_step is None
                       else replace(step, highest_step=log.highest_step))
        else:
            out.append(_escalation(step, f"run {run}: {why}; not restarting it again "
                                         f"({alertname}); the job itself is likely at fault",
                                   guard="crash_loop"))
    if why is not None:  # the checkpoint before the refused restart is not needed
        out = [replace(s, skip=why) if _before_restart(s) else s for s in out]
    return out


def _nan_guard(config: BridgeConfig, plan: list[PlanStep], run: str, alertname: str,
               log: History) -> list[PlanStep]:
    """A restart for a non-finite value the run is known to replay becomes a notify."""
    if not log.persistent_nan or not config.incidents.nan_alert_re.fullmatch(alertname):
        return plan
    why = log.persistent_nan
    out: list[PlanStep] = []
    for step in plan:
        if step.kind == "restart":
            out.append(_escalation(step, f"run {run}: {why}; not restarting it again "
                                         f"({alertname}): the data or the model is at fault",
                                   guard="nan_persistent"))
        elif _before_restart(step):
            out.append(replace(step, skip=why))
        else:
            out.append(step)
    return out


def _nan_pending_guard(config: BridgeConfig, plan: list[PlanStep], alertname: str,
                       log: History) -> list[PlanStep]:
    """A restart for a non-finite value while the verdict on the run's last one is awaited is
    skipped (and the checkpoint before it)."""
    if not log.nan_pending or not config.incidents.nan_alert_re.fullmatch(alertname):
        return plan
    why = log.nan_pending
    return [replace(s, skip=why, guard="nan_pending") if s.kind == "restart"
            else replace(s, skip=why) if _before_restart(s) else s for s in plan]


def decide(config: BridgeConfig, alert: AlertFacts, log: History, now: float) -> Decision:
    """What the bridge does for `alert` at `now`, given the policy and its run's history."""
    rule = match_rule(config, alert.labels)
    if rule is None:
        return Decision("ignore", None, [], 0.0, "no rule matched")
    plan = build_plan(config, rule, alert.labels)
    due = not_before(rule, alert.starts_at)
    if now < due:
        return Decision("wait", rule.name, plan, due,
                        f"for: acts once firing for {rule.for_s:.0f}s")
    run = alert.labels.get(config.run_label, "")
    cooldown = _cooldown(rule, run, log, now)
    if cooldown is not None:
        return Decision("skip", rule.name, plan, due, cooldown)
    alertname = alert.labels.get("alertname", "")
    plan = _nan_guard(config, plan, run, alertname, log)
    plan = _crash_loop_guard(config, plan, run, alertname, log)
    plan = _budget(config, plan, run, alertname, log, now)
    plan = _nan_pending_guard(config, plan, alertname, log)  # a restart that stays waits
    return Decision("run", rule.name, plan, due)
