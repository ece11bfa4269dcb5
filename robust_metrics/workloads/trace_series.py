"""A what-if op trace as the per-rank series the hook would have published, scraped every 15 s.

`robust-metrics whatif` and the online rules (alert_rules/stragglers.yml, attribution.yml)
estimate the same slowdown S and verdict from different inputs: the what-if from every op of a
few sampled steps, the rules from each rank's step and compute counters. To put both on one job
without running it, this module plays a trace's sampled steps end to end, in step order and over
again for as long as asked (the sampled steps stand for the job's steps), and gives what a scrape
every 15 s would see of each traced rank, counted as the hook counts:

- a step lasts, on every rank, from the step's first op to its last (the trace times each step
  from its earliest start; every rank's optimizer follows the gradient-clip all-reduce that all
  ranks take part in, so the ranks end a step together);
- blocked time is the union of the rank's communication ops in the step (pipeline sends and
  receives, DP collectives, the layernorm, embedding and clip all-reduces: `optypes.COMM`): the
  time the rank waited for peers, as the hook sums the intervals it waits in. Batched sends and
  receives overlap and are counted once;
- compute is the step minus blocked time: compute ops, the optimizer, GC and the host time
  between ops (data loading, launches), which the hook cannot tell from compute either.

Only the series the straggler and attribution rules read are made: the step counter, the step
windows the hook keeps (its own `StepWindows` fed every played step, as straggler_series.
`RankWindows`), the last step's timestamp, the phase (`train` throughout) and
`robust_rank_info` with the rank's dp_rank, pp_rank (the trace's stage) and tp_rank 0 on node
`n<rank>`. It feeds the promtool case alert_rules/tests/whatif_st_test.yml
(written by `python -m tests.whatif_online_cases`). Needs the `analysis` extra (numpy, pandas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from robust_metrics.analysis.whatif import optypes
from robust_metrics.analysis.whatif.model import TraceModel
from robust_metrics.workloads.straggler_series import (
    SCRAPE_S,
    RankWindows,
    Scrape,
    scrape_series,
)

__all__ = ["RankSteps", "promtool_series", "rank_steps", "scrapes", "topology"]


@dataclass(frozen=True)
class RankSteps:
    """Each traced step (in the model's step order) as the hook would time it on each rank."""

    ranks: list[int]          # global ranks, in (stage, dp_rank) order
    duration: np.ndarray      # (steps,): seconds of each step, the same on every rank
    compute: np.ndarray       # (ranks, steps): step minus time blocked in communication
    blocked: np.ndarray       # (ranks, steps)


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the intervals (overlaps counted once)."""
    total, begin, end = 0.0, 0.0, -math.inf
    for s, e in sorted(intervals):
        if s > end:
            total += max(0.0, end - begin)
            begin, end = s, e
        else:
            end = max(end, e)
    return total + max(0.0, end - begin)


def topology(model: TraceModel) -> dict[int, dict[str, str]]:
    """Each traced rank's coordinates, as labels of `robust_rank_info`."""
    dp, pp = model.rank_of.shape
    return {int(model.rank_of[d, s]): {"dp_rank": str(d), "pp_rank": str(s), "tp_rank": "0"}
            for s in range(pp) for d in range(dp)}


def rank_steps(model: TraceModel) -> RankSteps:
    """Step, compute and blocked seconds of every traced rank in every step of the trace."""
    dp, pp = model.rank_of.shape
    end = model.end
    duration = end.max(axis=(0, 1))  # every step's ops start from its earliest start, 0
    comm = np.isin(model.op_type, optypes.COMM)
    stage = model.op_stage
    ranks, blocked = [], []
    for s in range(pp):
        ops = np.flatnonzero(comm & (stage == s))
        for d in range(dp):
            ranks.append(int(model.rank_of[d, s]))
            blocked.append([
                _union(list(zip(model.start[ops, d, k], end[ops, d, k], strict=True)))
                for k in range(len(model.steps))])
    waited = np.minimum(np.array(blocked), duration)
    return RankSteps(ranks, duration, duration - waited, waited)


def scrapes(model: TraceModel, minutes: float) -> list[list[Scrape]]:
    """Per scrape (at 0, 15, 30 s, ... up to `minutes`), one `Scrape` per traced rank: the
    trace's steps played end to end from time 0, in step order, repeated until then."""
    timed = rank_steps(model)
    n_ranks, n_steps = timed.compute.shape
    steps, compute = np.zeros(n_ranks), np.zeros(n_ranks)
    windows = [RankWindows() for _ in range(n_ranks)]
    last, k = 0.0, 0  # the last step's end (the steps' seconds: played from 0), steps played
    out: list[list[Scrape]] = []
    for i in range(int(minutes * 60 // SCRAPE_S) + 1):
        now = i * SCRAPE_S
        while last + timed.duration[k % n_steps] <= now:
            j = k % n_steps
            steps += 1
            compute += timed.compute[:, j]
            last += timed.duration[j]
            for r, rank_windows in enumerate(windows):
                rank_windows.add(float(last), float(timed.duration[j]),
                                 float(timed.compute[r, j]))
            k += 1
        out.append([Scrape(now, rank, int(steps[r]), float(compute[r]), float(last), float(last),
                           False, windows[r].read())
                    for r, rank in enumerate(timed.ranks)])
    return out


def promtool_series(model: TraceModel, run: str, minutes: float) -> list[dict[str, str]]:
    """promtool `input_series` of the traced ranks over `minutes` of the trace played on."""
    return scrape_series(scrapes(model, minutes), run, topology=topology(model))
