"""Chrome/Perfetto trace JSON of the original and the ideal timelines, side by side.

Open it in https://ui.perfetto.dev or chrome://tracing: process 1 is the original (the trace
replayed without launch delays), process 2 the ideal; one thread per rank; steps laid end to end.
Large jobs are cut to a few steps and DP ranks so the file stays loadable.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from robust_metrics.analysis.whatif.analysis import ideal_durations
from robust_metrics.analysis.whatif.model import TraceModel
from robust_metrics.analysis.whatif.simulate import simulate

__all__ = ["chrome_trace"]


def chrome_trace(model: TraceModel, *, steps: int = 2, dp_ranks: int = 64) -> dict[str, Any]:
    """The trace-event JSON object for the first `steps` steps and `dp_ranks` DP ranks."""
    graph = model.graph
    n_steps = min(steps, len(model.steps))
    n_dp = min(dp_ranks, model.dp)
    d, x = model.duration[:, :n_dp, :n_steps], model.transfer[:, :n_dp, :n_steps]
    ideal_d, ideal_x = ideal_durations(model)
    shape = d.shape
    timelines = {
        1: ("original (no launch delays)", simulate(graph, d, x)),
        2: ("ideal (mean compute, median communication)", simulate(graph, ideal_d, ideal_x)),
    }
    stage = model.op_stage
    events: list[dict[str, Any]] = []
    for pid, (label, tl) in timelines.items():
        start = np.broadcast_to(tl.start, shape)
        end = np.broadcast_to(tl.end, shape)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        offsets = np.concatenate([[0.0], np.cumsum(end.max(axis=(0, 1)))])
        for dp in range(n_dp):
            for s in range(model.meta.pp_size):
                rank = int(model.rank_of[dp, s])
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                               "args": {"name": f"rank {rank} (dp {dp}, stage {s})"}})
        for k in range(n_steps):
            for op in range(graph.n_ops):
                info = graph.ops[op]
                for dp in range(n_dp):
                    events.append({
                        "ph": "X", "name": info.optype, "cat": info.optype, "pid": pid,
                        "tid": int(model.rank_of[dp, stage[op]]),
                        "ts": round((offsets[k] + start[op, dp, k]) * 1e6, 3),
                        "dur": round((end[op, dp, k] - start[op, dp, k]) * 1e6, 3),
                        "args": {"op": info.name, "step": int(model.steps[k]), "dp_rank": dp,
                                 "stage": int(stage[op])}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"steps": [int(s) for s in model.steps[:n_steps]],
                          "dp_ranks_shown": n_dp, "dp_ranks": model.dp}}
