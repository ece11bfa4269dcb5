"""The dependency model: one op graph shared by every DP rank and step of a trace.

An op is named by (optype, seq_id, stage). The graph is inferred from one model-parallel group
(DP rank 0) in the first step, following the what-if method (straggler study, OSDI'25):
compute chains, pipeline p2p streams paired across stages, DP collectives, the end-of-step chain,
and synchronising groups. `OpGraph.schedule` is a topological order computed once, so the
simulator is a straight loop over ops with numpy vectors over (DP rank, step).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from robust_metrics.analysis.whatif import optypes as T

__all__ = ["GraphError", "Op", "OpGraph", "build_graph"]

P2P_EPS = 5e-5
"""Seconds of tolerance when deciding whether a send/recv lies outside the step's computes."""


class GraphError(ValueError):
    """The trace's ops do not form a consistent dependency graph; the message names the op."""


class Op(NamedTuple):
    """One op of the shared graph, with its observed times in the MP group it was built from."""

    optype: str
    seq_id: int
    stage: int
    start: float
    end: float
    mc: int
    gmc: int

    @property
    def name(self) -> str:
        return f"{self.optype}_{self.seq_id}_{self.stage}"


@dataclass
class OpGraph:
    """Ops, their in-rank dependencies, and the groups whose members end together."""

    ops: list[Op]
    deps: list[list[int]]
    group: np.ndarray  # op -> group id, -1 for ops simulated like compute
    groups: list[list[int]]
    group_dp_sync: list[bool]
    schedule: list[tuple[int, int]] = field(default_factory=list)
    """(op, group completed right after it starts or -1): a topological start order."""

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    def index(self) -> dict[tuple[str, int, int], int]:
        return {(op.optype, op.seq_id, op.stage): i for i, op in enumerate(self.ops)}

    def name(self, i: int) -> str:
        return self.ops[i].name


def _sorted(ops: Sequence[Op]) -> list[Op]:
    return sorted(ops, key=lambda o: (o.start, o.seq_id, o.optype))


class _Builder:
    def __init__(self, ops: Sequence[Op], pp: int, vpp: int, use_dp: bool) -> None:
        self.ops = list(ops)
        self.pp, self.vpp, self.use_dp = pp, vpp, use_dp
        self.idx = {(o.optype, o.seq_id, o.stage): i for i, o in enumerate(self.ops)}
        self.deps: list[list[int]] = [[] for _ in self.ops]
        self.groups: list[list[int]] = []
        self.dp_sync: list[bool] = []
        self.by_stage: dict[int, list[Op]] = {}
        for op in self.ops:
            self.by_stage.setdefault(op.stage, []).append(op)
        self.overlapped_dp = any(o.optype == T.SEPARATE_GRADS_ALL_REDUCE for o in self.ops)

    def i(self, op: Op) -> int:
        return self.idx[(op.optype, op.seq_id, op.stage)]

    def find(self, optype: str, seq_id: int, stage: int) -> int | None:
        return self.idx.get((optype, seq_id, stage))

    def dep(self, op: int, on: int) -> None:
        self.deps[op].append(on)

    def chain(self, ops: Sequence[int], after: Sequence[int] = ()) -> None:
        last = list(after)
        for op in ops:
            self.deps[op].extend(last)
            last = [op]

    def stage_ops(self, stage: int, *types: str) -> list[Op]:
        return _sorted([o for o in self.by_stage.get(stage, []) if o.optype in types])

    # -- 1 + 2: compute chain and pipeline p2p ------------------------------------------------
    def pipeline(self) -> None:
        valid: dict[tuple[str, int], list[int]] = {}  # (optype, stage) -> valid ops in order
        no_ops: list[int] = []
        for stage in sorted(self.by_stage):
            comp = self.stage_ops(stage, T.FORWARD_COMPUTE, T.BACKWARD_COMPUTE)
            self.chain([self.i(o) for o in comp])
            for optype in T.P2P:
                self.chain([self.i(o) for o in self.stage_ops(stage, optype)])
            for direction in ("forward", "backward"):
                dcomp = [o for o in comp if o.optype == f"{direction}-compute"]
                for kind in ("send", "recv"):
                    optype = f"{direction}-{kind}"
                    comms = self.stage_ops(stage, optype)
                    if not comms:
                        continue
                    v, n = self.match(stage, direction, kind, comms, dcomp)
                    valid[(optype, stage)] = v
                    no_ops.extend(n)
            self.first_backward_p2p(stage, comp)
        for (optype, stage), ops in valid.items():
            if optype not in (T.FORWARD_SEND, T.BACKWARD_SEND):
                continue
            peer_type = T.FORWARD_RECV if optype == T.FORWARD_SEND else T.BACKWARD_RECV
            peer_stage = (stage + (1 if optype == T.FORWARD_SEND else -1)) % self.pp
            peers = valid.get((peer_type, peer_stage), [])
            if len(peers) != len(ops):
                raise GraphError(
                    f"{len(ops)} valid {optype} ops on stage {stage} but {len(peers)} valid "
                    f"{peer_type} ops on stage {peer_stage}; first unpaired: "
                    f"{self.ops[(ops if len(ops) > len(peers) else peers)[min(len(ops), len(peers))]].name}")
            for a, b in zip(ops, peers, strict=True):
                self.groups.append([a, b])
                self.dp_sync.append(False)
        for (optype, stage), ops in valid.items():
            if optype in (T.FORWARD_RECV, T.BACKWARD_RECV):
                peer_type = T.FORWARD_SEND if optype == T.FORWARD_RECV else T.BACKWARD_SEND
                peer_stage = (stage + (-1 if optype == T.FORWARD_RECV else 1)) % self.pp
                if len(valid.get((peer_type, peer_stage), [])) != len(ops):
                    raise GraphError(f"{self.ops[ops[0]].name}: its peer stream {peer_type} on "
                                     f"stage {peer_stage} has a different number of valid ops")
        for op in no_ops:
            self.groups.append([op])
            self.dp_sync.append(False)

    def match(self, stage: int, direction: str, kind: str, comms: list[Op], dcomp: list[Op],
              ) -> tuple[list[int], list[int]]:
        """Match each send/recv to its compute; return (valid ops, no-ops) in time order."""
        if dcomp:
            last_start = max(o.start for o in dcomp)
            first_end = min(o.end for o in dcomp)
        else:
            last_start, first_end = -math.inf, math.inf

        def outside(o: Op) -> bool:  # a "type 1" no-op at the start or end of the step
            if kind == "recv":
                return o.start > last_start + P2P_EPS
            return o.end < first_end - P2P_EPS

        count = sum(not outside(o) for o in comms)
        compute_id = 0
        if count != len(dcomp):
            if stage not in (0, self.pp - 1) or not (count == 0 or count + 1 == len(dcomp)):
                raise GraphError(
                    f"{comms[0].name}: stage {stage} has {count} {direction}-{kind} ops inside "
                    f"the step but {len(dcomp)} {direction}-compute ops (p2p ops are missing)")
            if kind == "recv" and count + 1 == len(dcomp):
                compute_id = 1
        delta = {("forward", "send"): 1, ("forward", "recv"): -1,
                 ("backward", "send"): -1, ("backward", "recv"): 1}[(direction, kind)]
        by_seq = {o.seq_id: o for o in dcomp}
        valid, no_ops = [], []
        for o in comms:
            i = self.i(o)
            if outside(o):
                no_ops.append(i)
                continue
            compute = by_seq.get(compute_id)
            if compute is None:
                raise GraphError(f"{o.name}: no {direction}-compute with seq_id {compute_id} on "
                                 f"stage {stage} to match it with")
            c = self.i(compute)
            if kind == "send":
                self.dep(i, c)
            else:
                self.dep(c, i)
                before = by_seq.get(compute_id - 1)
                if before is not None:
                    self.dep(i, self.i(before))
            peer_gmc = compute.gmc + delta
            if 0 <= peer_gmc < self.vpp * self.pp:
                valid.append(i)
            else:  # "type 2": the first/last global model chunk has no peer
                no_ops.append(i)
            compute_id += 1
        return valid, no_ops

    def first_backward_p2p(self, stage: int, comp: list[Op]) -> None:
        """1F1B warm-up: the first backward send/recv waits for the forward two computes earlier."""
        first = next((k for k, o in enumerate(comp) if o.optype == T.BACKWARD_COMPUTE), None)
        if first is None or first < 2:
            return
        for k in (first - 1, first - 2):
            if comp[k].optype != T.FORWARD_COMPUTE:
                raise GraphError(f"{comp[first].name}: expected forward computes before the first "
                                 f"backward compute on stage {stage}, found {comp[k].name}")
        for optype in (T.BACKWARD_RECV, T.BACKWARD_SEND):
            op = self.find(optype, 0, stage)
            if op is not None:
                self.dep(op, self.i(comp[first - 2]))

    # -- 3: data-parallel communication --------------------------------------------------------
    def data_parallel(self) -> None:
        for stage in sorted(self.by_stage):
            dp_ops = self.stage_ops(stage, T.PARAMS_ALL_GATHER, T.GRADS_REDUCE_SCATTER)
            self.chain([self.i(o) for o in dp_ops])
            comp = self.stage_ops(stage, T.FORWARD_COMPUTE, T.BACKWARD_COMPUTE)
            gathers = sorted(self.stage_ops(stage, T.PARAMS_ALL_GATHER), key=lambda o: o.seq_id)
            assigned: set[int] = set()
            for ag in reversed(gathers):
                if ag.mc in assigned:
                    continue
                fwd = [o for o in comp if o.optype == T.FORWARD_COMPUTE and o.mc == ag.mc]
                if not fwd:
                    raise GraphError(f"{ag.name}: no forward-compute of model chunk {ag.mc} on "
                                     f"stage {stage} waits for it")
                self.dep(self.i(min(fwd, key=lambda o: o.start)), self.i(ag))
                assigned.add(ag.mc)
            if self.overlapped_dp:
                assigned = set()
                scatters = sorted(self.stage_ops(stage, T.GRADS_REDUCE_SCATTER),
                                  key=lambda o: o.seq_id)
                for rs in scatters:
                    if rs.mc in assigned:
                        continue
                    bwd = [o for o in comp if o.optype == T.BACKWARD_COMPUTE and o.mc == rs.mc]
                    if not bwd:
                        raise GraphError(f"{rs.name}: no backward-compute of model chunk {rs.mc} "
                                         f"on stage {stage} precedes it")
                    self.dep(self.i(rs), self.i(max(bwd, key=lambda o: o.end)))
                    assigned.add(rs.mc)
        for op in self.ops:
            if op.optype in T.DP_COMM:
                self.groups.append([self.i(op)])
                self.dp_sync.append(True)

    # -- 4: end of step --------------------------------------------------------------------------
    def end_of_step(self) -> None:
        for stage in sorted(self.by_stage):
            comp = self.stage_ops(stage, T.FORWARD_COMPUTE, T.BACKWARD_COMPUTE)
            if not comp:
                raise GraphError(f"stage {stage} has no forward/backward-compute ops")
            last = [self.i(max(comp, key=lambda o: o.end))]
            gc = self.find(T.GC, 0, stage)
            if gc is not None:
                self.dep(gc, last[0])
                last = [gc]
            scatters = [self.i(o) for o in sorted(self.stage_ops(stage, T.GRADS_REDUCE_SCATTER),
                                                  key=lambda o: o.seq_id)]
            chain = [self.find(T.LAYERNORM_ALL_REDUCE, 0, stage)]
            if stage in (0, self.pp - 1):
                chain.append(self.find(T.EMBEDDING_ALL_REDUCE, 0, stage))
            if self.overlapped_dp:
                if scatters:
                    last = [scatters[-1], *last]
                chain.append(self.find(T.SEPARATE_GRADS_ALL_REDUCE, 0, stage))
            else:
                chain.extend(scatters)
            chain += [self.find(T.CLIP, 0, stage), self.find(T.OPTIMIZER, 0, stage)]
            present = [op for op in chain if op is not None]
            if self.find(T.OPTIMIZER, 0, stage) is None:
                raise GraphError(f"stage {stage} has no optimizer op (seq_id 0) ending the step")
            self.chain(present, after=last)

    # -- 5: groups across stages ---------------------------------------------------------------
    def cross_stage_groups(self) -> None:
        emb = [self.find(T.EMBEDDING_ALL_REDUCE, 0, s) for s in sorted({0, self.pp - 1})]
        if any(e is not None for e in emb):
            self.groups.append([e for e in emb if e is not None])
            self.dp_sync.append(False)
        clips = [self.find(T.CLIP, 0, s) for s in sorted(self.by_stage)]
        if any(c is not None for c in clips):
            self.groups.append([c for c in clips if c is not None])
            self.dp_sync.append(True)

    def build(self) -> OpGraph:
        self.pipeline()
        if self.use_dp:
            self.data_parallel()
        self.end_of_step()
        self.cross_stage_groups()
        group = np.full(len(self.ops), -1, dtype=np.int64)
        for gid, members in enumerate(self.groups):
            for op in members:
                if group[op] >= 0:
                    raise GraphError(f"{self.ops[op].name} is in two synchronising groups")
                group[op] = gid
        deps = [sorted(set(d), key=d.index) for d in self.deps]
        graph = OpGraph(self.ops, deps, group, self.groups, self.dp_sync)
        graph.schedule = _schedule(graph)
        return graph


def _schedule(graph: OpGraph) -> list[tuple[int, int]]:
    """Kahn's order where a group ends once all its members have started; name ops in a cycle."""
    n = graph.n_ops
    indeg = [len(d) for d in graph.deps]
    succ: list[list[int]] = [[] for _ in range(n)]
    for v, deps in enumerate(graph.deps):
        for u in deps:
            succ[u].append(v)
    started = [0] * len(graph.groups)
    queue = deque(v for v in range(n) if indeg[v] == 0)
    schedule: list[tuple[int, int]] = []
    done = [False] * n

    def finish(ops: Sequence[int]) -> None:
        for u in ops:
            done[u] = True
            for v in succ[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    queue.append(v)

    while queue:
        v = queue.popleft()
        gid = int(graph.group[v])
        if gid < 0:
            schedule.append((v, -1))
            finish([v])
            continue
        started[gid] += 1
        if started[gid] == len(graph.groups[gid]):
            schedule.append((v, gid))
            finish(graph.groups[gid])
        else:
            schedule.append((v, -1))
    if len(schedule) != n:
        stuck = [graph.ops[v].name for v in range(n) if not done[v]]
        raise GraphError(f"the op graph has a cycle or an unreachable op: {len(stuck)} ops never "
                         f"become ready, e.g. {', '.join(stuck[:5])}")
    return schedule


def build_graph(ops: Sequence[Op], *, pp: int, vpp: int = 1, use_dp: bool = True) -> OpGraph:
    """The dependency model for the ops of one MP group in one step (see the module docstring)."""
    seen: set[tuple[str, int, int]] = set()
    for op in ops:
        key = (op.optype, op.seq_id, op.stage)
        if key in seen:
            raise GraphError(f"{op.name} appears twice in one step of one DP rank")
        seen.add(key)
    return _Builder(ops, pp, vpp, use_dp).build()
