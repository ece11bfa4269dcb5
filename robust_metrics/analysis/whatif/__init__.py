"""What-if straggler analysis (straggler study, OSDI'25): how much faster would this job be
without its stragglers, and who are they?

    from robust_metrics.analysis.whatif import analyze_trace
    result = analyze_trace("trace.parquet", meta="meta.yaml")
    print(result.slowdown, result.by_stage, result.mw, result.ms)

Or from the shell: `robust-metrics whatif TRACE [--meta META.yaml] [--out DIR] [--json]`.
The method is in docs/whatif.md; the trace can come from an imported profile or from
`robust_metrics.watch(..., trace_dir=..., trace_every=N)`.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from robust_metrics.analysis.whatif.analysis import WhatIfResult, analyze
from robust_metrics.analysis.whatif.graph import GraphError
from robust_metrics.analysis.whatif.loader import TraceError, read_trace
from robust_metrics.analysis.whatif.meta import JobMeta, MetaError, load_meta
from robust_metrics.analysis.whatif.model import TraceModel, build_model
from robust_metrics.analysis.whatif.steps import StepRanges

__all__ = ["GraphError", "JobMeta", "MetaError", "TraceError", "TraceModel", "WhatIfResult",
           "analyze", "analyze_trace", "build_model", "load_meta", "load_model", "read_trace"]


def load_model(trace: str | Path, meta: str | Path | None = None,
               overrides: dict[str, int | None] | None = None,
               steps: Collection[int] | None = None) -> TraceModel:
    """Read a trace (and optional metadata YAML) into a `TraceModel` ready to simulate.

    `steps` keeps only those steps (e.g. to leave out a warm-up step).
    """
    df = read_trace(trace)
    if steps is not None:
        keep = (steps.mask(df.step.to_numpy()) if isinstance(steps, StepRanges)
                else df.step.isin(list(steps)))
        if not keep.any():
            raise TraceError(f"trace {trace} has none of the requested steps; it has steps "
                             f"{sorted(set(df.step.tolist()))[:20]}")
        df = df[keep].reset_index(drop=True)
    inferred = {"dp_size": int(df.dp_rank.max()) + 1, "pp_size": int(df.stage.max()) + 1,
                "vpp_size": max(1, int(df.mc.max()) + 1)}
    job = load_meta(meta, overrides, inferred=inferred)
    return build_model(df, job)


def analyze_trace(trace: str | Path, meta: str | Path | None = None,
                  **kwargs: Any) -> WhatIfResult:
    """Load and analyse a trace in one call; kwargs go to `analyze`."""
    return analyze(load_model(trace, meta), **kwargs)
