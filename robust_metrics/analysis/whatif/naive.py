"""The simplest correct simulator: one op instance at a time, no numpy, no shared graph order.

It exists to check the vectorised simulator and to measure what vectorising buys (bench/whatif.py).
It repeats the topological sort for every DP rank and step and resolves groups with dictionaries.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from robust_metrics.analysis.whatif.graph import OpGraph

__all__ = ["simulate_naive"]


def simulate_naive(graph: OpGraph, duration: np.ndarray, transfer: np.ndarray) -> np.ndarray:
    """Per-step time (latest op end) for arrays of shape (n_ops, lanes, steps), no launch delays."""
    steps = duration.shape[2]
    step_time = np.zeros(steps)
    succ: dict[int, list[int]] = {}
    for v, deps in enumerate(graph.deps):
        for u in deps:
            succ.setdefault(u, []).append(v)
    for step in range(steps):
        step_time[step] = _one_step(graph, duration[:, :, step], transfer[:, :, step], succ)
    return step_time


def _one_step(graph: OpGraph, duration: np.ndarray, transfer: np.ndarray,
              succ: dict[int, list[int]]) -> float:
    n_ops, lanes = duration.shape
    start: dict[tuple[int, int], float] = {}
    end: dict[tuple[int, int], float] = {}
    indeg = {(v, lane): len(graph.deps[v]) for v in range(n_ops) for lane in range(lanes)}
    queue = deque(k for k, d in indeg.items() if d == 0)
    waiting: dict[int, set[tuple[int, int]]] = {}
    while queue:
        op, lane = queue.popleft()
        start[(op, lane)] = max((end[(u, lane)] for u in graph.deps[op]), default=0.0)
        gid = int(graph.group[op])
        if gid < 0:
            end[(op, lane)] = start[(op, lane)] + float(duration[op, lane])
            finished = [(op, lane)]
        else:
            sync = graph.group_dp_sync[gid]
            members = {(u, ln) for u in graph.groups[gid] for ln in (range(lanes) if sync
                                                                      else [lane])}
            key = gid * lanes + (0 if sync else lane)
            waiting.setdefault(key, set()).add((op, lane))
            finished = []
            if waiting[key] == members:
                latest = max(start[m] for m in members)
                for m in members:
                    end[m] = latest + float(transfer[m])
                finished = sorted(members)
        for u, ln in finished:
            for v in succ.get(u, []):
                indeg[(v, ln)] -= 1
                if indeg[(v, ln)] == 0:
                    queue.append((v, ln))
    return max(end.values())
