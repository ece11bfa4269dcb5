"""A step as an action runs it: its context, its outcome, and the bridge's shutdown.

The engine hands every action a `StepContext` and records the `Outcome` it returns; an action
that sees the bridge stopping raises `Interrupted`, and its step resumes at the next start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from robust_metrics.bridge.plan import PlanStep
from robust_metrics.bridge.schedulers.base import Scheduler
from robust_metrics.bridge.store import Incident, Step

__all__ = ["Interrupted", "Outcome", "SchedulerFor", "StepContext"]

# The scheduler a step runs through: (the step, a name or None for its own) -> (name, scheduler)
SchedulerFor = Callable[["StepContext", "str | None"], tuple[str, Scheduler]]


class Interrupted(Exception):
    """The bridge is shutting down; the step stays `running` and resumes at the next start."""


@dataclass
class StepContext:
    """One step as the engine hands it to its action: the incident, the planned step (given in
    its stored form, it is read into a `PlanStep`), a way to save progress durably, and what a
    previous attempt saved."""

    incident: Incident
    idx: int
    spec: PlanStep
    save: Callable[[Mapping[str, Any]], None]
    data: dict[str, Any] = field(default_factory=dict)
    resumed: bool = False
    earlier: Sequence[Step] = ()  # the incident's steps before this one, as recorded

    def __post_init__(self) -> None:
        self.spec = PlanStep.from_dict(self.spec)

    @property
    def key(self) -> str:
        """Idempotency key of this step, passed to schedulers and webhook receivers."""
        return f"{self.incident.key}#{self.idx}"

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.spec.options)

    @property
    def dry_run(self) -> bool:
        return self.spec.dry_run


@dataclass(frozen=True)
class Outcome:
    status: str  # success, failed, skipped, dry_run
    detail: str
    data: dict[str, Any] = field(default_factory=dict)
