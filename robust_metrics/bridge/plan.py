"""A decided plan: the steps the bridge runs for one incident, as typed values.

`policy.decide` writes the plan, `store` keeps it as JSON in the incident's row (the bridge
resumes it after its own restart), `engine` walks it and `actions` runs each step. A step is a
`PlanStep`: the action (`kind`) and its options from the rule, plus what the policy decided about
it (skipped and why, the restart a notify replaces, the guard that refused a restart, the highest
step a restart saw, a drain of every suspect's node, dry run).

The stored form is the JSON object the bridge has always written: `type`, `continue_on_error`,
`options`, `dry_run`, and each marker only when it is set (`skip`, `escalated_from`, `guard`,
`highest_step`, `over_evict`). So a plan written before this type existed loads as it was, and a
log written now can still be read by the bridge before it. A step also reads as that stored form
(`step["type"]`, `step.get("skip")`): a read-only mapping, for the audit trail and its readers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["PlanStep", "dump_plan", "load_plan"]


@dataclass(frozen=True)
class PlanStep(Mapping[str, Any]):
    """One step of a decided plan (frozen: a decision, once taken, is not edited in place)."""

    kind: str  # checkpoint, dump_stacks, selftest, restart, drain_node, notify (config.ACTIONS)
    options: Mapping[str, Any] = field(default_factory=dict)
    continue_on_error: bool = False
    dry_run: bool = False
    skip: str | None = None  # why the policy skips it (the checkpoint before a refused restart)
    escalated_from: str | None = None  # the action this notify replaces (a refused restart)
    guard: str | None = None  # what refused it: crash_loop or nan_persistent
    highest_step: float | None = None  # a restart: the run's highest step when it was decided
    over_evict: bool = False  # a drain_node of every node holding a suspect of the stack dump

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"a plan step needs an action name, got {self.kind!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def before_restart(self) -> bool:
        """The checkpoint the policy put before a `restart` with `checkpoint_first`."""
        return bool(self.options.get("before_restart"))

    # ------------------------------------------------------------------ stored form
    def to_dict(self) -> dict[str, Any]:
        """The JSON object the store writes (markers only when set)."""
        out: dict[str, Any] = {"type": self.kind, "continue_on_error": self.continue_on_error,
                               "options": dict(self.options), "dry_run": self.dry_run}
        for key in ("skip", "escalated_from", "guard", "highest_step"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.over_evict:
            out["over_evict"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanStep:
        """A step from its stored form, as this bridge or an earlier one wrote it; keys it does
        not know (a later bridge's) are left out."""
        if isinstance(data, PlanStep):
            return data
        highest = data.get("highest_step")
        return cls(
            kind=data.get("type"),  # type: ignore[arg-type]  # checked in __post_init__
            options=dict(data.get("options") or {}),
            continue_on_error=bool(data.get("continue_on_error", False)),
            dry_run=bool(data.get("dry_run", False)),
            skip=_text(data.get("skip")),
            escalated_from=_text(data.get("escalated_from")),
            guard=_text(data.get("guard")),
            highest_step=float(highest) if isinstance(highest, int | float)
            and not isinstance(highest, bool) else None,
            over_evict=bool(data.get("over_evict", False)))

    # ------------------------------------------------------------------ read as a mapping
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def load_plan(steps: Any) -> list[PlanStep]:
    """A plan from its stored form (a JSON list of step objects)."""
    return [PlanStep.from_dict(s) for s in steps or []]


def dump_plan(plan: list[PlanStep]) -> list[dict[str, Any]]:
    """A plan's stored form."""
    return [s.to_dict() for s in plan]
