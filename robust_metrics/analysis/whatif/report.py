"""The readable summary printed by `robust-metrics whatif`: numbers first, then what they suggest.

The interpretation follows the straggler study: M_W high means a few workers explain the
slowdown (look at their hardware); M_S high means the last pipeline stage is heavier than the
others (rebalance layers); neither means a spread-out cause such as sequence-length imbalance
across microbatches or Python GC pauses.
"""

from __future__ import annotations

from robust_metrics.analysis.whatif.analysis import WhatIfResult

__all__ = ["EXPLAINS", "VERDICTS", "diagnosis", "summary", "verdict"]

EXPLAINS = 0.5
"""M_W or M_S at or above this means that group explains most of the slowdown."""


VERDICTS = ("none", "worker", "stage", "spread")
"""The study's kinds of cause; the online rules record the same words
(`run:robust_straggler_verdict:class5m{verdict=...}` in alert_rules/attribution.yml)."""


def verdict(result: WhatIfResult) -> str:
    """none (not attributed), worker (M_W explains most, at least as much as M_S), stage (M_S
    explains most), else spread."""
    if not result.attributed:
        return "none"
    mw, ms = result.mw or 0.0, result.ms or 0.0
    if mw >= EXPLAINS and mw >= ms:
        return "worker"
    return "stage" if ms >= EXPLAINS else "spread"


def diagnosis(result: WhatIfResult) -> str:
    """One sentence on the likely kind of cause."""
    kind = verdict(result)
    if kind == "none" and not result.covered:
        return (f"nothing can be attributed: the traced ops explain only {result.coverage:.0%} "
                "of the step, the rest lies between them, where a straggler is invisible")
    if kind == "none":
        return (f"no straggling worth attributing (S below {result.threshold}"
                "): the job runs close to its ideal")
    mw, ms = result.mw or 0.0, result.ms or 0.0
    ranks = ", ".join(str(r) for r in (result.mw_detail or {}).get("ranks", []))
    if kind == "worker":
        return (f"one bad worker (or a few): fixing rank(s) {ranks} removes {mw:.0%} of the "
                "slowdown; check their GPU, NIC and host (the sidecar's metrics), or cordon them")
    if kind == "stage":
        return (f"a heavy last pipeline stage: making stage {result.meta['pp_size'] - 1} ideal "
                f"removes {ms:.0%} of the slowdown; move layers off the last stage (loss and "
                "output layers make it heavier)")
    return (f"a spread-out cause: no single worker (M_W {mw:.0%}) or the last stage (M_S {ms:.0%}) "
            "explains it; suspect sequence-length imbalance across microbatches, Python GC "
            "pauses (gc op type) or data loading")


def _top(d: dict | None, n: int, fmt: str = "{k}") -> str:
    if not d:
        return "-"
    return ", ".join(f"{fmt.format(k=k)}: {v:.4f}" for k, v in list(d.items())[:n])


def summary(result: WhatIfResult, top: int = 5) -> str:
    """A multi-line text summary of a result."""
    r = result
    worst = sorted(r.step_slowdown.items(), key=lambda kv: -kv[1])[:top]
    lines = [
        f"what-if straggler analysis: {len(r.step_slowdown)} steps, dp {r.meta['dp_size']} x "
        f"pp {r.meta['pp_size']}",
        f"  slowdown S = {r.slowdown:.4f}  (mean step: original {r.t_original:.4f} s, ideal "
        f"{r.t_ideal:.4f} s, traced {r.t_trace:.4f} s)",
        f"  coverage = {r.coverage:.3f}  (share of the traced step the traced ops explain; "
        f"attribution needs {r.min_coverage:g})",
        "  worst steps: " + ", ".join(f"{s}: {v:.4f}" for s, v in worst),
    ]
    if r.dropped_steps:
        lines.append(f"  dropped {len(r.dropped_steps)} step(s) not traced on every worker")
    lines.extend(f"  WARNING: {w}" for w in r.warnings)
    if r.attributed:
        lines += [
            f"  top ranks (score = min(S_dp, S_stage)): {_top(r.rank_scores, top, 'rank {k}')}",
            f"  by stage: {_top(r.by_stage, top, 'stage {k}')}",
            f"  by DP rank: {_top(r.by_dp_rank, top, 'dp {k}')}",
            f"  by op type: {_top(r.by_optype, top)}",
            f"  M_W = {r.mw:.3f} (share removed by fixing the top "
            f"{len((r.mw_detail or {}).get('ranks', []))} rank(s)), "
            + (f"M_S = {r.ms:.3f} (share removed by fixing the last stage)" if r.ms is not None
               else "M_S n/a (one pipeline stage)"),
        ]
    lines.append(f"  suggests: {diagnosis(r)}")
    return "\n".join(lines)
