"""What-if results: slowdown S, per-step S, attribution, heatmap scores, M_W and M_S.

Original = the trace replayed without launch delays. Ideal = the original with every compute op's
duration replaced by the mean of its type, every communication op's duration and transfer time by
the median of its type. S = mean original step time / mean ideal step time. Attribution restores
one group of ops (a DP rank, a stage, an op type) to its original durations inside the ideal.
Coverage = mean original step time / mean traced step time: the share of the step that the
traced ops explain. Attribution needs S >= 1.03 (the study's threshold) and coverage >= 0.8
(`MIN_COVERAGE`: below it, the step's time lies mostly between ops, where a straggler is
invisible, and blaming the ranks the trace does show would mislead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from robust_metrics.analysis.whatif import optypes as T
from robust_metrics.analysis.whatif.model import TraceModel
from robust_metrics.analysis.whatif.simulate import Timeline, simulate

__all__ = ["ATTRIBUTION_THRESHOLD", "MIN_COVERAGE", "TOP_WORKER_FRACTION", "WhatIfResult",
           "analyze", "coverage_warning", "ideal_durations"]

ATTRIBUTION_THRESHOLD = 1.03
"""Attribution (and M_W, M_S) is computed only when S reaches this."""
MIN_COVERAGE = 0.8
"""Attribution is computed only when the replay of the traced ops (without launch delays)
explains at least this share of the traced step time. The rest is launch delay: time between
ops that the graph does not explain (data loading, host work, a sleep), which the method sets
to 0. A rank whose extra time lies there is invisible to the attribution, while the ranks that
wait for it are not; below 0.8 an untraced straggler of 1.25x fits in the gap, more than the
study's attribution threshold (1.03) by far and four times its simulator's P90 error (5.5%), so
the ranking of ranks and stages says nothing about the job's real straggler."""
TOP_WORKER_FRACTION = 0.03
"""M_W removes the top ceil(3% of ranks) ranks by heatmap score."""

Progress = Callable[[Iterable[Any], str, int], Iterable[Any]]


def _no_progress(items: Iterable[Any], label: str, total: int) -> Iterable[Any]:
    return items


@dataclass
class WhatIfResult:
    """All numbers of one analysis; `to_json()` is the `--json` output."""

    slowdown: float
    step_slowdown: dict[int, float]
    t_original: float
    t_ideal: float
    t_trace: float
    step_time_original: dict[int, float]
    step_time_ideal: dict[int, float]
    step_time_trace: dict[int, float]
    meta: dict[str, Any]
    by_dp_rank: dict[int, float] | None = None
    by_stage: dict[int, float] | None = None
    by_optype: dict[str, float] | None = None
    heatmap: list[list[float]] | None = None  # [dp][stage]
    rank_scores: dict[int, float] | None = None
    mw: float | None = None
    ms: float | None = None
    mw_detail: dict[str, Any] | None = None
    ms_detail: dict[str, Any] | None = None
    dropped_steps: list[int] = field(default_factory=list)
    coverage: float = 1.0
    """Mean replay step time without launch delays / mean traced step time."""
    min_coverage: float = MIN_COVERAGE
    threshold: float = ATTRIBUTION_THRESHOLD

    @property
    def attributed(self) -> bool:
        return self.by_dp_rank is not None

    @property
    def covered(self) -> bool:
        """Whether the traced ops explain enough of the step to attribute (`MIN_COVERAGE`)."""
        return self.coverage >= self.min_coverage

    @property
    def warnings(self) -> list[str]:
        return [] if self.covered else [coverage_warning(self)]

    def to_json(self) -> dict[str, Any]:
        def keyed(d: dict[Any, float] | None) -> dict[str, float] | None:
            return None if d is None else {str(k): float(v) for k, v in d.items()}

        return {
            "slowdown": self.slowdown,
            "step_slowdown": keyed(self.step_slowdown),
            "by_dp_rank": keyed(self.by_dp_rank),
            "by_stage": keyed(self.by_stage),
            "by_optype": keyed(self.by_optype),
            "mw": self.mw, "ms": self.ms,
            "t_original": self.t_original, "t_ideal": self.t_ideal, "t_trace": self.t_trace,
            "step_time_original": keyed(self.step_time_original),
            "step_time_ideal": keyed(self.step_time_ideal),
            "step_time_trace": keyed(self.step_time_trace),
            "heatmap": self.heatmap, "rank_scores": keyed(self.rank_scores),
            "mw_detail": self.mw_detail, "ms_detail": self.ms_detail,
            "attribution_threshold": self.threshold,
            "coverage": self.coverage, "min_coverage": self.min_coverage,
            "warnings": self.warnings,
            "meta": self.meta, "dropped_steps": self.dropped_steps,
        }


def coverage_warning(result: WhatIfResult) -> str:
    """Why a result was not attributed for lack of coverage, in one sentence."""
    return (f"the traced ops explain only {result.coverage:.0%} of the traced step time "
            f"(replay {result.t_original:.4f} s of {result.t_trace:.4f} s; at least "
            f"{result.min_coverage:.0%} is needed to attribute): the rest lies between ops "
            "(data loading, host work, waits the trace does not show), where a straggler is "
            "invisible to this analysis; no rank or stage is blamed. Trace that work (the hook's "
            "span()) or look at the online SlowRank and straggler rules")


def ideal_durations(model: TraceModel) -> tuple[np.ndarray, np.ndarray]:
    """Per-op ideal duration and transfer time, shape (n_ops, 1, 1), constant per op type."""
    types = model.op_type
    duration = np.empty((model.graph.n_ops, 1, 1))
    transfer = np.empty_like(duration)
    for optype in np.unique(types):
        ops = np.flatnonzero(types == optype)
        if optype in T.COMM:
            duration[ops] = np.median(model.duration[ops])
            transfer[ops] = np.median(model.transfer[ops])
        else:
            duration[ops] = model.duration[ops].mean()
            transfer[ops] = model.transfer[ops].mean()
    return duration, transfer


def _mean_ratio(t: np.ndarray, t_ideal: np.ndarray) -> float:
    return float(t.mean() / t_ideal.mean())


def analyze(model: TraceModel, *, threshold: float = ATTRIBUTION_THRESHOLD,
            min_coverage: float = MIN_COVERAGE,
            progress: Progress = _no_progress) -> WhatIfResult:
    """Run the what-if analysis of a trace model (see the module docstring). Attribution needs
    S >= `threshold` and a coverage (replay / traced step time) >= `min_coverage`."""
    graph = model.graph
    original = simulate(graph, model.duration, model.transfer)
    t_ori = original.step_time
    ideal_d, ideal_x = ideal_durations(model)
    ideal = simulate(graph, ideal_d, ideal_x)
    t_ideal = np.broadcast_to(ideal.step_time, t_ori.shape)
    t_trace = (model.end.max(axis=(0, 1)))
    steps = [int(s) for s in model.steps]
    s_total = _mean_ratio(t_ori, t_ideal)
    meta = {k: getattr(model.meta, k) for k in model.meta.__dataclass_fields__}
    result = WhatIfResult(
        slowdown=s_total,
        step_slowdown={s: float(a / b) for s, a, b in zip(steps, t_ori, t_ideal, strict=True)},
        t_original=float(t_ori.mean()), t_ideal=float(t_ideal.mean()),
        t_trace=float(t_trace.mean()),
        step_time_original=dict(zip(steps, map(float, t_ori), strict=True)),
        step_time_ideal=dict(zip(steps, map(float, t_ideal), strict=True)),
        step_time_trace=dict(zip(steps, map(float, t_trace), strict=True)),
        meta=meta, dropped_steps=model.dropped_steps, min_coverage=min_coverage,
        threshold=threshold)
    traced = float(t_trace.mean())
    result.coverage = float(t_ori.mean()) / traced if traced > 0 else 1.0
    if s_total < threshold or not result.covered:
        return result
    base = _Scenarios(model, ideal_d, ideal_x, float(t_ideal.mean()), original)
    result.by_dp_rank = _sorted(base.by_dp_rank(progress))
    stages = model.op_stage
    result.by_stage = _sorted({int(s): base.restore(stages == s)
                               for s in progress(np.unique(stages), "stages", model.meta.pp_size)})
    folded = np.array([T.fold_optype(t) for t in model.op_type])
    kinds = sorted({str(k) for k in folded})
    result.by_optype = _sorted({k: base.restore(folded == k)
                                for k in progress(kinds, "op types", len(kinds))})
    heat = np.array([[min(result.by_dp_rank[d], result.by_stage[s])
                      for s in range(model.meta.pp_size)] for d in range(model.dp)])
    result.heatmap = heat.tolist()
    scores = {int(model.rank_of[d, s]): float(heat[d, s])
              for d in range(model.dp) for s in range(model.meta.pp_size)}
    result.rank_scores = dict(sorted(scores.items(), key=lambda kv: (-kv[1], kv[0])))
    n_top = math.ceil(len(scores) * TOP_WORKER_FRACTION)
    top = list(result.rank_scores)[:n_top]
    worker = np.isin(model.rank_of, top)  # (dp, pp)
    worker_mask = worker[:, stages].T[:, :, None]  # (n_ops, dp, 1)
    result.mw_detail = {**base.explain(worker_mask), "ranks": top}
    result.mw = result.mw_detail["rem"]
    if model.meta.pp_size > 1:  # with one stage, "the last stage" is the whole job
        last = (stages == model.meta.pp_size - 1)[:, None, None]
        result.ms_detail = {**base.explain(last), "stage": model.meta.pp_size - 1}
        result.ms = result.ms_detail["rem"]
    return result


def _sorted(d: dict[Any, float]) -> dict[Any, float]:
    return dict(sorted(d.items(), key=lambda kv: -kv[1]))


class _Scenarios:
    """Simulations that mix original and ideal durations for a subset of ops."""

    def __init__(self, model: TraceModel, ideal_d: np.ndarray, ideal_x: np.ndarray,
                 t_ideal: float, original: Timeline) -> None:
        self.model = model
        self.ideal_d, self.ideal_x = ideal_d, ideal_x
        self.t_ideal = t_ideal
        self.t_ori = float(original.step_time.mean())

    def _mix(self, mask: np.ndarray, restore: bool) -> tuple[np.ndarray, np.ndarray]:
        m = self.model
        if restore:  # ideal everywhere, original where mask
            return (np.where(mask, m.duration, self.ideal_d),
                    np.where(mask, m.transfer, self.ideal_x))
        return (np.where(mask, self.ideal_d, m.duration), np.where(mask, self.ideal_x, m.transfer))

    def restore(self, op_mask: np.ndarray) -> float:
        """S_g: the ideal with the ops in op_mask (per op, or (n_ops, dp, 1)) at original values."""
        mask = op_mask if op_mask.ndim == 3 else op_mask[:, None, None]
        d, x = self._mix(mask, restore=True)
        return float(simulate(self.model.graph, d, x).step_time.mean() / self.t_ideal)

    def by_dp_rank(self, progress: Progress) -> dict[int, float]:
        """S per DP rank, all at once: the other DP ranks are identical (ideal), so one ideal
        lane stands in for all of them and every DP rank becomes a batch of steps."""
        m = self.model
        n_ops, dp, steps = m.duration.shape
        if dp == 1:
            return {0: self.restore(np.ones(n_ops, dtype=bool))}
        result: dict[int, float] = {}
        chunk = max(1, int(2e7 // max(1, n_ops * steps * 2)))
        for lo in progress(range(0, dp, chunk), "DP ranks", math.ceil(dp / chunk)):
            hi = min(dp, lo + chunk)
            g = hi - lo
            d = np.empty((n_ops, 2, g * steps))
            x = np.empty_like(d)
            d[:, 0] = m.duration[:, lo:hi].reshape(n_ops, g * steps)
            x[:, 0] = m.transfer[:, lo:hi].reshape(n_ops, g * steps)
            d[:, 1] = self.ideal_d[:, 0]
            x[:, 1] = self.ideal_x[:, 0]
            t = simulate(m.graph, d, x).step_time.reshape(g, steps)
            for k in range(g):
                result[lo + k] = float(t[k].mean() / self.t_ideal)
        return result

    def explain(self, mask: np.ndarray) -> dict[str, float]:
        """Remove (original with mask ideal) and add (ideal with mask original) the masked ops."""
        d, x = self._mix(mask, restore=False)
        t_rem = float(simulate(self.model.graph, d, x).step_time.mean())
        d, x = self._mix(mask, restore=True)
        t_add = float(simulate(self.model.graph, d, x).step_time.mean())
        span = self.t_ori - self.t_ideal
        return {"trem": t_rem, "tadd": t_add, "tori": self.t_ori, "tideal": self.t_ideal,
                "rem": (self.t_ori - t_rem) / span, "add": (t_add - self.t_ideal) / span}
