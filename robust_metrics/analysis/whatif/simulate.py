"""The vectorised what-if simulator.

Every DP rank and step shares one op graph, so the simulator walks the graph's topological
schedule once and carries numpy arrays of shape (lanes, steps) per op: one Python iteration per
op, not per op instance. A synchronising group ends when its last member has started; each member
ends at the group's latest start (latest over lanes too for DP-synchronised groups) plus its own
transfer time. Lanes are DP ranks, or (for attribution) stand-ins for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from robust_metrics.analysis.whatif.graph import OpGraph

__all__ = ["Timeline", "simulate"]


@dataclass
class Timeline:
    """Simulated start and end of every op, shape (n_ops, lanes, steps), seconds from step start."""

    start: np.ndarray
    end: np.ndarray

    @property
    def step_time(self) -> np.ndarray:
        """Per step: latest end over all ops and lanes (every step starts at 0)."""
        return self.end.max(axis=(0, 1))


def simulate(graph: OpGraph, duration: np.ndarray, transfer: np.ndarray,
             delay: np.ndarray | None = None) -> Timeline:
    """Replay the graph with the given per-op-instance durations.

    duration, transfer, delay: arrays broadcastable to (n_ops, lanes, steps). `duration` is used
    for ops outside synchronising groups, `transfer` for members of a group, `delay` (launch
    delay, default none) is added to every op's start.
    """
    shape = np.broadcast_shapes(duration.shape, transfer.shape,
                                delay.shape if delay is not None else (1, 1, 1))
    if shape[0] != graph.n_ops:
        raise ValueError(f"duration arrays cover {shape[0]} ops but the graph has {graph.n_ops}")
    start = np.empty(shape, dtype=np.float64)
    end = np.empty(shape, dtype=np.float64)
    zero = np.zeros(shape[1:], dtype=np.float64)
    deps = graph.deps
    group = graph.group
    for op, completes in graph.schedule:
        d = deps[op]
        if not d:
            s = zero
        elif len(d) == 1:
            s = end[d[0]]
        else:
            s = np.maximum(end[d[0]], end[d[1]])
            for u in d[2:]:
                np.maximum(s, end[u], out=s)
        if delay is not None:
            s = s + delay[op if delay.shape[0] > 1 else 0]
        start[op] = s
        if group[op] < 0:
            end[op] = start[op] + duration[op if duration.shape[0] > 1 else 0]
        elif completes >= 0:
            members = graph.groups[completes]
            latest = start[members[0]].copy()
            for u in members[1:]:
                np.maximum(latest, start[u], out=latest)
            if graph.group_dp_sync[completes]:
                latest = latest.max(axis=0, keepdims=True)
            for u in members:
                end[u] = latest + transfer[u if transfer.shape[0] > 1 else 0]
    return Timeline(start, end)
