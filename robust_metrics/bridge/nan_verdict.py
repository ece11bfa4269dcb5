"""Transient or persistent: does a non-finite value follow the data or the machine?

After a NaN incident the run restarts from a checkpoint before the bad step S and meets S again.
If the non-finite value comes back at S, it follows the data or the model (a bad batch, an
unstable layer): restarting again replays it, so the bridge stops restarting the run and says
so. If the run passes S cleanly, the value came from the machine (silent data corruption, a
flaky GPU): the node of the rank that reported it first gets a suspect mark and a compute
self-test. Pure functions over what Prometheus answered, so the ledger and its tests share them.

The hook publishes `robust_nonfinite_first_step` (the first non-finite step of each rank
process). Values are read one step late on GPUs, so a step counts as passed cleanly only once
the run is two steps beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from robust_metrics.numbers import rank_order

__all__ = ["NanEvidence", "NanVerdict", "first_report", "nan_verdict"]

NanVerdict = Literal["persistent", "transient", "recurred_elsewhere"]


@dataclass(frozen=True)
class NanEvidence:
    """What the ledger read: the first non-finite step before the restart and its rank, the
    first non-finite step after it (None: none), and the run's step after it."""

    step: float | None
    rank: str | None
    recurred_step: float | None
    step_after: float | None


def first_report(steps: dict[str, float]) -> tuple[str, float] | None:
    """(rank, step) of the first non-finite value: the lowest step, then the lowest rank."""
    if not steps:
        return None
    rank = min(steps, key=lambda r: (steps[r], rank_order(r)))
    return rank, steps[rank]


def nan_verdict(evidence: NanEvidence) -> NanVerdict | None:
    """The verdict, or None while the run has not yet met the step again."""
    if evidence.step is None:
        return None
    if evidence.recurred_step is not None:
        if evidence.recurred_step == evidence.step:
            return "persistent"
        if evidence.recurred_step < evidence.step:
            return "recurred_elsewhere"
    if evidence.step_after is not None and evidence.step_after >= evidence.step + 2:
        return "transient"
    return None
