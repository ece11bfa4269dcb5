"""From an alert to a plan: which rule matches, which steps run, and from when.

Kept apart from HTTP and from the action code so the decisions are plain functions of the alert
and the policy, easy to test and to read in an audit: the plan is stored with the incident.

Two decisions are made here, at accept time, because they depend on the alert alone:
- the `for` guard: an instance acts only once it has been firing for `for_s` (startsAt + for_s); a
  resolution that arrives first cancels it;
- `restart` with `checkpoint_first`: a checkpoint step is put before the restart, unless the alert
  says the job is hung (a hung rank cannot write a checkpoint, so asking would only add the
  checkpoint timeout to the outage).
Decisions that depend on history (cooldown, restart budget) are made when the plan runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from robust_metrics.bridge.config import ActionSpec, BridgeConfig, Rule
from robust_metrics.bridge.payload import parse_time

__all__ = ["build_plan", "is_hang", "match_rule", "not_before", "parse_time"]


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


def build_plan(config: BridgeConfig, rule: Rule, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The rule's chain with defaults filled in: each step names its scheduler and dry-run mode."""
    hung = is_hang(config, labels)
    plan: list[dict[str, Any]] = []
    for spec in rule.actions:
        options = dict(spec.options)
        if spec.type in ("restart", "drain_node"):
            options["scheduler"] = options.get("scheduler") or rule.scheduler
        if spec.type == "restart" and options.get("checkpoint_first") and not hung:
            plan.append(ActionSpec(
                "checkpoint", continue_on_error=not options.get("require_checkpoint", False),
                options={"timeout_s": options.get("checkpoint_timeout_s", 120.0),
                         "at_step": None, "before_restart": True}).to_dict())
        plan.append(ActionSpec(spec.type, spec.continue_on_error, options).to_dict())
    dry = config.dry_run or rule.dry_run
    for step in plan:
        step["dry_run"] = dry
    return plan
