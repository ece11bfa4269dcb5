"""A trace as arrays over (op, DP rank, step), with the graph, transfer times and launch delays.

Rows of the trace are placed into dense arrays indexed by the shared graph's op index, so that
each op is one numpy vector over DP ranks and steps. Timestamps are made relative to each step's
earliest start, as every step is simulated from time 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd

from robust_metrics.analysis.whatif import optypes as T
from robust_metrics.analysis.whatif.graph import GraphError, Op, OpGraph, build_graph
from robust_metrics.analysis.whatif.loader import TraceError
from robust_metrics.analysis.whatif.meta import JobMeta

__all__ = ["NEGATIVE_TOLERANCE", "TraceModel", "build_model"]

log = logging.getLogger(__name__)

NEGATIVE_TOLERANCE = 1e-2
"""Transfer times and launch delays at or below minus this many seconds are set to 0."""


@dataclass
class TraceModel:
    """Everything the simulator and the attribution need, as arrays (n_ops, dp, steps)."""

    meta: JobMeta
    graph: OpGraph
    steps: np.ndarray            # step numbers, in array order
    start: np.ndarray            # observed start, seconds since the step's first start
    duration: np.ndarray         # observed duration
    transfer: np.ndarray         # group members: end - latest start in the group; else duration
    delay: np.ndarray            # launch delay: start - latest end of dependencies
    rank_of: np.ndarray          # (dp, pp): global rank of each worker
    dropped_steps: list[int]

    @property
    def dp(self) -> int:
        return int(self.duration.shape[1])

    @property
    def op_stage(self) -> np.ndarray:
        return np.array([op.stage for op in self.graph.ops])

    @property
    def op_type(self) -> np.ndarray:
        return np.array([op.optype for op in self.graph.ops], dtype=object)

    @property
    def end(self) -> np.ndarray:
        return self.start + self.duration


def _complete_steps(df: pd.DataFrame, dp: int, pp: int) -> tuple[np.ndarray, list[int]]:
    """Steps that every (dp_rank, stage) worker traced, and the steps dropped for lacking one."""
    all_steps, step_idx = np.unique(df.step.to_numpy(), return_inverse=True)
    worker = (step_idx * dp + df.dp_rank.to_numpy()) * pp + df.stage.to_numpy()
    present = np.unique(worker) // (dp * pp)
    workers = np.bincount(present, minlength=len(all_steps))
    complete = all_steps[workers == dp * pp]
    dropped = [int(s) for s in all_steps[workers != dp * pp]]
    if len(complete) == 0:
        raise TraceError(f"no step of the trace has ops from all {dp * pp} workers "
                         f"(dp {dp} x pp {pp}); was every rank traced?")
    return complete, dropped


def build_model(df: pd.DataFrame, meta: JobMeta) -> TraceModel:
    """Place a validated trace into arrays, build the graph, derive transfer times and delays."""
    dp = int(df.dp_rank.max()) + 1
    pp = int(df.stage.max()) + 1
    meta.check_trace(dp, pp, int(df.mc.max()) + 1)
    steps, dropped = _complete_steps(df, dp, pp)
    if dropped:
        log.warning("what-if: dropping %d step(s) not traced on every worker: %s",
                    len(dropped), dropped[:10])
        df = df[df.step.isin(steps)]
    step_index = np.searchsorted(steps, df.step.to_numpy())
    step_start = np.full(len(steps), np.inf)
    np.minimum.at(step_start, step_index, df.start_ts.to_numpy())
    rel_start = df.start_ts.to_numpy() - step_start[step_index]

    first = (df.dp_rank.to_numpy() == 0) & (step_index == 0)
    mp = df[first]
    mp_start = rel_start[first]
    ops = [Op(str(o), int(q), int(s), float(st), float(st + d), int(m), int(g))
           for o, q, s, st, d, m, g in zip(mp.optype, mp.seq_id, mp.stage, mp_start,
                                          mp.duration, mp.mc, mp.gmc, strict=True)]
    graph = build_graph(ops, pp=pp, vpp=meta.vpp_size,
                        use_dp=meta.dp_size * meta.dsp_size > 1
                        or any(o.optype in T.DP_COMM for o in ops))
    index = graph.index()

    # one integer key per (optype, seq_id, stage): hashing ints is far cheaper than tuples
    type_codes = df.optype.cat.codes.to_numpy().astype(np.int64)
    type_names = [str(c) for c in df.optype.cat.categories]
    seq = df.seq_id.to_numpy()
    stage_col = df.stage.to_numpy()
    key = (type_codes * (int(seq.max()) + 1) + seq) * pp + stage_col
    codes, uniques = pd.factorize(key)
    n_seq = int(seq.max()) + 1
    op_of_unique = np.empty(len(uniques), dtype=np.int64)
    for k, u in enumerate(uniques.tolist()):
        name_key = (type_names[u // pp // n_seq], u // pp % n_seq, u % pp)
        op = index.get(name_key)
        if op is None:
            row = int(np.argmax(codes == k))
            raise GraphError(f"op {'_'.join(map(str, name_key))} (dp_rank "
                             f"{int(df.dp_rank.iat[row])}, step {int(df.step.iat[row])}) is not "
                             f"in the graph built from dp_rank 0, step {steps[0]}: every DP rank "
                             "and step must run the same ops")
        op_of_unique[k] = op
    op_idx = op_of_unique[codes]
    dp_idx = df.dp_rank.to_numpy()
    n_ops, n_steps = graph.n_ops, len(steps)
    flat = (op_idx * dp + dp_idx) * n_steps + step_index
    counts = np.bincount(flat, minlength=n_ops * dp * n_steps)
    if counts.max() > 1:
        o, d, s = np.unravel_index(int(np.argmax(counts > 1)), (n_ops, dp, n_steps))
        raise GraphError(f"op {graph.name(o)} appears more than once on dp_rank {d} in step "
                         f"{steps[s]}")
    if counts.min() == 0:
        o, d, s = np.unravel_index(int(np.argmax(counts == 0)), (n_ops, dp, n_steps))
        raise GraphError(f"op {graph.name(o)} is missing on dp_rank {d} in step {steps[s]}")
    shape = (n_ops, dp, n_steps)
    start = np.empty(n_ops * dp * n_steps)
    start[flat] = rel_start
    duration = np.empty_like(start)
    duration[flat] = df.duration.to_numpy()
    start, duration = start.reshape(shape), duration.reshape(shape)

    rank_of = np.full((dp, pp), -1, dtype=np.int64)
    pairs = df[step_index == 0][["dp_rank", "stage", "rank"]].drop_duplicates()
    if pairs.duplicated(["dp_rank", "stage"]).any():
        bad = pairs[pairs.duplicated(["dp_rank", "stage"], keep=False)].iloc[0]
        raise TraceError(f"dp_rank {bad.dp_rank}, stage {bad.stage} is traced from more than one "
                         "rank; keep one TP rank per (dp_rank, stage)")
    rank_of[pairs.dp_rank.to_numpy(), pairs.stage.to_numpy()] = pairs["rank"].to_numpy()

    end = start + duration
    transfer = _transfer_times(graph, start, end, duration)
    delay = _launch_delays(graph, start, end)
    return TraceModel(meta, graph, steps, start, duration, transfer, delay, rank_of, dropped)


def _transfer_times(graph: OpGraph, start: np.ndarray, end: np.ndarray,
                    duration: np.ndarray) -> np.ndarray:
    """End minus the latest start among the group's participants (over DP ranks if synced)."""
    transfer = duration.copy()
    for gid, members in enumerate(graph.groups):
        latest = start[members].max(axis=0)
        if graph.group_dp_sync[gid]:
            latest = latest.max(axis=0, keepdims=True)
        for op in members:
            transfer[op] = end[op] - latest
    transfer[transfer <= -NEGATIVE_TOLERANCE] = 0.0
    return transfer


def _launch_delays(graph: OpGraph, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Start minus the latest end of the op's dependencies (or the step start, 0)."""
    delay = np.empty_like(start)
    for op, deps in enumerate(graph.deps):
        ready = end[deps].max(axis=0) if deps else 0.0
        delay[op] = start[op] - ready
    delay[delay <= -NEGATIVE_TOLERANCE] = 0.0
    return delay
