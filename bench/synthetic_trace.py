"""Synthetic what-if traces with known causes, for the what-if tests and benchmark (bench/whatif.py).

They live in bench/, not in the package: no user runs them (a user's traces come from the hook's
`trace_dir`), and the benchmark must not import tests/, so the tests import them from here, as the
Slurm tests import bench/slurm_cluster.py.

A small executor runs a Megatron-style 1F1B schedule (PP x DP, no interleaving) as per-stage
programs: compute ops run back to back; p2p ops are posted in batches (like Megatron's batched
isend/irecv) and end at the later of the two peers' starts plus a transfer time; DP collectives,
the embedding all-reduce and the gradient-clip all-reduce wait for all their participants. It
is independent of the analysis' dependency model: the analysis has to infer the graph from the
timestamps this writes, as it does for a real trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from robust_metrics.analysis.whatif import optypes as T

__all__ = ["SyntheticJob", "generate"]


@dataclass
class SyntheticJob:
    """Sizes, base durations (seconds) and injected causes of a synthetic job."""

    dp: int = 4
    pp: int = 4
    microbatches: int = 4
    steps: int = 6
    forward: float = 0.010
    backward: float = 0.020
    p2p: float = 0.0005
    dp_comm: float = 0.004
    layernorm: float = 0.0002
    embedding: float = 0.001
    clip: float = 0.0005
    optimizer: float = 0.003
    gc: float = 0.0002
    noise: float = 0.01
    """Relative uniform noise on every compute duration (+-)."""
    worker_factor: Mapping[tuple[int, int], float] = field(default_factory=dict)
    """(dp_rank, stage) -> compute slowdown factor, e.g. {(1, 2): 2.0}."""
    stage_factor: Mapping[int, float] = field(default_factory=dict)
    """stage -> compute slowdown factor, e.g. a heavy last stage {3: 1.5}."""
    seed: int = 0
    step_gap: float = 10.0
    """Seconds between step starts in the written timestamps (steps are independent)."""


def _program(job: SyntheticJob, s: int) -> list[tuple[str, object]]:
    """Instructions of stage s: ("c", (optype, mb)) compute or ("p", [(optype, key), ...])."""
    pp, m = job.pp, job.microbatches
    warm = min(pp - s - 1, m)
    prog: list[tuple[str, object]] = []

    def recv_f(i: int) -> tuple[str, object]:
        return (T.FORWARD_RECV, ("F", s - 1, i))

    def send_f(i: int) -> tuple[str, object]:
        return (T.FORWARD_SEND, ("F", s, i))

    def recv_b(i: int) -> tuple[str, object]:
        return (T.BACKWARD_RECV, ("B", s + 1, i))

    def send_b(i: int) -> tuple[str, object]:
        return (T.BACKWARD_SEND, ("B", s, i))

    first, last = s == 0, s == pp - 1
    if job.dp > 1:
        prog.append(("p", [(T.PARAMS_ALL_GATHER, ("AG", s))]))
    for i in range(warm):
        if not first:
            prog.append(("p", [recv_f(i)]))
        prog.append(("c", (T.FORWARD_COMPUTE, i)))
        if not last:
            prog.append(("p", [send_f(i)]))
    if m - warm > 0 and not first:
        prog.append(("p", [recv_f(warm)]))
    for i in range(m - warm):
        prog.append(("c", (T.FORWARD_COMPUTE, warm + i)))
        if not last:
            prog.append(("p", [send_f(warm + i), recv_b(i)]))
        prog.append(("c", (T.BACKWARD_COMPUTE, i)))
        if not first:
            tail = [send_b(i)] if i == m - warm - 1 else [send_b(i), recv_f(warm + i + 1)]
            prog.append(("p", tail))
    for i in range(m - warm, m):
        if not last:
            prog.append(("p", [recv_b(i)]))
        prog.append(("c", (T.BACKWARD_COMPUTE, i)))
        if not first:
            prog.append(("p", [send_b(i)]))
    prog.append(("c", (T.GC, 0)))
    prog.append(("c", (T.LAYERNORM_ALL_REDUCE, -1)))
    if first or last:
        prog.append(("p", [(T.EMBEDDING_ALL_REDUCE, ("EMB",))]))
    if job.dp > 1:
        prog.append(("p", [(T.GRADS_REDUCE_SCATTER, ("RS", s))]))
    prog.append(("p", [(T.CLIP, ("CLIP",))]))
    prog.append(("c", (T.OPTIMIZER, -1)))
    return prog


def _participants(job: SyntheticJob, key: tuple) -> int:
    if key[0] in ("F", "B"):
        return 2
    if key[0] == "EMB":
        return 1 if job.pp == 1 else 2
    if key[0] == "CLIP":
        return job.pp
    return 1  # AG/RS: one stage, all DP lanes at once


def generate(job: SyntheticJob) -> pd.DataFrame:
    """Run the executor; return the trace as a DataFrame in the what-if schema."""
    rng = np.random.default_rng(job.seed)
    lanes = (job.dp, job.steps)
    programs = [_program(job, s) for s in range(job.pp)]
    pc = [0] * job.pp
    clock = [np.zeros(lanes) for _ in range(job.pp)]
    posted: dict[tuple, dict[int, np.ndarray]] = {}
    pending: list[list[tuple[str, tuple, np.ndarray]] | None] = [None] * job.pp
    records: list[tuple[int, str, int, np.ndarray, np.ndarray]] = []  # stage, optype, mb, st, en
    base = {T.FORWARD_COMPUTE: job.forward, T.BACKWARD_COMPUTE: job.backward, T.GC: job.gc,
            T.LAYERNORM_ALL_REDUCE: job.layernorm, T.OPTIMIZER: job.optimizer}
    transfer = {T.PARAMS_ALL_GATHER: job.dp_comm, T.GRADS_REDUCE_SCATTER: job.dp_comm,
                T.EMBEDDING_ALL_REDUCE: job.embedding, T.CLIP: job.clip}
    worker = np.ones((job.dp, job.pp))
    for (d, s), f in job.worker_factor.items():
        worker[d, s] = f
    while any(pc[s] < len(programs[s]) for s in range(job.pp)):
        progressed = False
        for s in range(job.pp):
            while pc[s] < len(programs[s]):
                kind, what = programs[s][pc[s]]
                if kind == "c":
                    optype, mb = what  # type: ignore[misc]
                    dur = base[optype] * np.ones(lanes)
                    if optype in (T.FORWARD_COMPUTE, T.BACKWARD_COMPUTE):
                        dur = (dur * job.stage_factor.get(s, 1.0) * worker[:, s, None]
                               * (1 + job.noise * rng.uniform(-1, 1, lanes)))
                    records.append((s, optype, mb, clock[s], clock[s] + dur))
                    clock[s] = clock[s] + dur
                    pc[s] += 1
                    progressed = True
                    continue
                if pending[s] is None:
                    pending[s] = []
                    for optype, key in what:  # type: ignore[union-attr]
                        posted.setdefault(key, {})[s] = clock[s]
                        pending[s].append((optype, key, clock[s]))
                    progressed = True
                if not all(len(posted[k]) == _participants(job, k) for _, k, _ in pending[s]):
                    break
                ends = []
                for optype, key, st in pending[s]:
                    latest = np.maximum.reduce(list(posted[key].values()))
                    if key[0] in ("AG", "RS", "CLIP"):
                        latest = np.broadcast_to(latest.max(axis=0, keepdims=True), lanes)
                    en = latest + transfer.get(optype, job.p2p)
                    records.append((s, optype, -1, st, en))
                    ends.append(en)
                clock[s] = np.maximum.reduce(ends)
                pending[s] = None
                pc[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"synthetic schedule deadlocked at {pc}")
    return _to_frame(job, records)


def _to_frame(job: SyntheticJob, records: list[tuple[int, str, int, np.ndarray, np.ndarray]],
              ) -> pd.DataFrame:
    seq: dict[tuple[int, str], int] = {}
    cols: dict[str, list[np.ndarray]] = {c: [] for c in (
        "dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id", "mc",
        "gmc", "mb_id")}
    dp_idx, step_idx = np.meshgrid(np.arange(job.dp), np.arange(job.steps), indexing="ij")
    n = job.dp * job.steps
    offset = (step_idx * job.step_gap).ravel()
    for s, optype, mb, st, en in sorted(records, key=lambda r: (r[0], float(r[3][0, 0]))):
        k = seq.get((s, optype), 0)
        seq[(s, optype)] = k + 1
        compute = optype in (T.FORWARD_COMPUTE, T.BACKWARD_COMPUTE)
        st = np.broadcast_to(st, (job.dp, job.steps)).ravel()
        en = np.broadcast_to(en, (job.dp, job.steps)).ravel()
        cols["dp_rank"].append(dp_idx.ravel())
        cols["stage"].append(np.full(n, s))
        cols["rank"].append(s * job.dp + dp_idx.ravel())
        cols["step"].append(step_idx.ravel())
        cols["optype"].append(np.full(n, optype, dtype=object))
        cols["start_ts"].append(st + offset)
        cols["duration"].append(en - st)
        cols["seq_id"].append(np.full(n, k))
        cols["mc"].append(np.full(n, 0 if compute or optype in T.DP_COMM else -1))
        cols["gmc"].append(np.full(n, s if compute else -1))
        cols["mb_id"].append(np.full(n, mb if compute else -1))
    df = pd.DataFrame({c: np.concatenate(v) for c, v in cols.items()})
    df["optype"] = df["optype"].astype("category")
    return df
