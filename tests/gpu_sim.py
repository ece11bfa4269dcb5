"""A discrete-event simulation of N ranks on GPUs, driving the hook's own estimator.

No GPU runs here, so the GPU timing path (`robust_metrics.hooks.timing` with CUDA events) is
proved against this model of what a GPU job does:

- each rank has a compute stream and a communication stream; the host runs `lead` steps ahead of
  its device (it only enqueues), so a step's marks are reached one step after the host closed it;
- DDP: backward produces gradient buckets in order, bucket k ready at (k+1)/K of the rank's
  backward; bucket k's all-reduce runs on the communication stream after bucket k-1's, overlapped
  with the rest of backward, and finishes `transfer` seconds after the LAST rank has it ready;
  backward returns on the compute stream when the last bucket is reduced (DDP's wait makes the
  stream wait); then the optimizer runs;
- plain collectives: a sync all-reduce after forward and one after backward, each finishing
  `transfer` after the last rank arrives, the compute stream waiting for it;
- fsdp: FSDP2 (`fully_shard` per layer) as torch/distributed/fsdp/_fully_shard issues it on
  CUDA. Forward: the all-gather streams wait for the optimizer (root pre-forward); each layer's
  all-gather is a sync `all_gather_single` called while the all-gather stream is current, an
  event recorded there; before copying out, that stream waits for the previous layer's copy-out
  event (so it runs at most one layer ahead: the implicit prefetch), and the compute stream waits
  for the all-gather's event (`foreach_all_gather_copy_out`). Backward, layers in reverse: the
  compute stream waits for the layer's all-gather, the next layer's all-gather is prefetched
  (with `reshard` only: `reshard_after_forward`), the layer's gradients computed, the compute
  stream waits for the previous reduce-scatter (one buffer in flight), the reduce-scatter stream
  waits for the compute stream and runs the layer's `reduce_scatter_single`; the root's final
  callback makes the compute stream wait for the last one. Each collective finishes `transfer`
  (all-gather) or `reduce_scatter` seconds after the last rank's stream reached it;
- pp: a pipeline, one stage per rank, `microbatches` per step under torch's GPipe or 1F1B
  schedule (pipelining/schedules.py): `irecv` and `isend` works (`_batch_p2p`), each receive
  waited with `Work.wait()` on the compute stream before the micro-batch's compute, sends waited
  where the schedule waits for them. A message completes `transfer` seconds after both its send
  and its receive were reached on their ranks' compute streams;
- megatron: Megatron-core 0.16.1's DistributedDataParallel and distributed optimizer
  (tests/megatron_like.py is the same job on gloo), one bucket group per layer of `buckets`
  buckets. Backward: when a layer's gradients are ready its bucket group's reduction (a
  reduce-scatter with `dist_opt`, else an all-reduce) is issued async inside
  `_coalescing_manager` (the per-bucket calls only record their ops, the block's end issues
  `ProcessGroup.*_coalesced`), on NCCL's stream, which starts it once the compute stream has got
  there and the previous collective is done; in the first step each group is issued by
  `finish_grad_sync` just before its wait instead (`is_first_batch`). `finish_grad_sync` waits on each handle
  (`Work.wait`: the compute stream waits), then the optimizer. With `dist_opt` the parameters
  are all-gathered after the optimizer step: with `overlap_param_gather` async, each layer's
  forward pre-hook waiting for its group's all-gather and issuing the next; without, as a sync
  coalesced block, which NCCL runs on the compute stream itself (torch then waits on its work,
  with nothing left to wait for). Each collective finishes `transfer` after the last rank's
  NCCL stream reached it.

Each rank keeps one time per stream (compute, all-gather, reduce-scatter). The hook's estimator
sees the simulation only through the `TimingSource` boundary: a mark is an event at the current
stream's time, reached once the device has got there. Every collective, `Work.wait()`,
`Stream.record_event` and `Stream.wait_event` goes through the hook's own wrappers
(`collectives/distributed.py`, `collectives/work.py`, `collectives/streams.py`) around a fake that moves the
streams' times; the same `StepTimer` and `CollectiveTracker` code as on a real rank turns marks
into step and blocked seconds; `online_estimate` then applies the alert rules' formulas
(alert_rules/stragglers.yml). Not modelled: compute slowed by communication kernels sharing the
GPU, NCCL's own stream ordering between messages, launch latency.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from robust_metrics.hooks.collectives import CollectiveTracker, streams
from robust_metrics.hooks.collectives.coalesced import wrap_coalesced
from robust_metrics.hooks.collectives.distributed import wrap_call
from robust_metrics.hooks.collectives.work import wrap_wait
from robust_metrics.hooks.timing import StepTimer

__all__ = ["Profile", "SimJob", "SimSource", "online_estimate", "simulate"]

COMPUTE, ALL_GATHER, REDUCE_SCATTER = "compute", "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class Profile:
    """Device seconds of one rank's phases per step."""

    forward: float = 0.030
    backward: float = 0.060
    optimizer: float = 0.010

    def scaled(self, phase: str, total_factor: float) -> Profile:
        """This profile with `phase` longer so the rank's whole compute is `total_factor` x."""
        extra = (total_factor - 1.0) * (self.forward + self.backward + self.optimizer)
        return replace(self, **{phase: getattr(self, phase) + extra})


@dataclass(frozen=True)
class SimJob:
    ranks: tuple[Profile, ...]
    mode: str = "ddp"  # or "plain", "fsdp", "pp", "megatron"
    buckets: int = 4
    # seconds per bucket all-reduce (ddp), per plain all-reduce, per layer's all-gather (fsdp),
    # per pipeline message (pp)
    transfer: float = 0.004
    steps: int = 40
    jitter: float = 0.02  # each op's duration varies uniformly by +-jitter
    lead: int = 1  # steps the host runs ahead of its device
    seed: int = 0
    layers: int = 4  # fsdp: `fully_shard` units, each forward and backward split evenly
    reduce_scatter: float = 0.005  # fsdp: seconds per layer's reduce-scatter
    reshard: bool = True  # fsdp: reshard_after_forward (all-gather again in backward)
    microbatches: int = 4  # pp
    dist_opt: bool = False  # megatron: the distributed optimizer (reduce-scatter, all-gather)
    overlap_param_gather: bool = False  # megatron: all-gathers overlapped with the next forward
    schedule: str = "gpipe"  # pp: or "1f1b"
    # every mark counted on whatever stream it is taken, and no wait between streams seen: the
    # design before side streams were told apart from the step's (collectives/streams.py)
    legacy: bool = False

    def ideal(self) -> SimJob:
        """Every rank's ops at the mean over ranks (the what-if method's ideal compute)."""
        n = len(self.ranks)
        mean = Profile(*(sum(getattr(p, f) for p in self.ranks) / n
                         for f in ("forward", "backward", "optimizer")))
        return replace(self, ranks=(mean,) * n)


@dataclass(frozen=True)
class SimMark:
    time: float
    stream: str = COMPUTE


class SimEvent:
    """A CUDA event: the time its stream reached it (the hook may tag it)."""

    def __init__(self, time: float) -> None:
        self.time = time


class SimSource:
    """The `TimingSource` boundary for one simulated rank: events on its current stream."""

    host = False

    def __init__(self, legacy: bool = False) -> None:
        self.streams = {COMPUTE: 0.0, ALL_GATHER: 0.0, REDUCE_SCATTER: 0.0}
        self.current = COMPUTE
        self.now = 0.0  # how far the device has got when the host looks
        self.early_reads = 0
        self.legacy = legacy

    @property
    def cursor(self) -> float:
        """The current stream's time at the op being enqueued."""
        return self.streams[self.current]

    @cursor.setter
    def cursor(self, time: float) -> None:
        self.streams[self.current] = time

    def mark(self) -> SimMark:
        return SimMark(self.cursor, self.current)

    def side_stream(self) -> str | None:
        return None if self.legacy or self.current == COMPUTE else self.current

    def is_step_stream(self, stream: Any) -> bool:
        return bool(stream == COMPUTE)

    def ready(self, mark: SimMark) -> bool:
        return mark.time <= self.now

    def elapsed(self, begin: SimMark, end: SimMark) -> float:
        if not (self.ready(begin) and self.ready(end)):  # would need a device synchronisation
            self.early_reads += 1
        return end.time - begin.time


@dataclass
class RankView:
    """What one rank's estimator produced, and the simulation's truth for it."""

    rank: int
    source: SimSource
    timer: StepTimer
    tracker: CollectiveTracker
    measured: list[tuple[float, float]] = field(default_factory=list)  # (step, blocked)
    true_compute: list[float] = field(default_factory=list)
    true_blocked: list[float] = field(default_factory=list)  # the compute stream's stalls
    reads: list[int] = field(default_factory=list)  # steps read at each step end


@dataclass
class SimResult:
    views: list[RankView]
    step_ends: list[list[float]]  # [step][rank] device time of the optimizer's end

    def mean_step(self) -> float:
        """Mean step time, over steps after the first, of the slowest rank's clock."""
        ends = [max(row) for row in self.step_ends]
        return (ends[-1] - ends[0]) / (len(ends) - 1)


def _errors(where: str, exc: BaseException) -> None:
    raise exc


def simulate(job: SimJob) -> SimResult:
    if job.mode in ("fsdp", "pp", "megatron"):
        return _simulate_streams(job)
    rng = random.Random(job.seed)
    n = len(job.ranks)
    views = []
    for rank in range(n):
        source = SimSource()
        timer = StepTimer(source)
        views.append(RankView(rank, source, timer, CollectiveTracker(_errors, timer)))
    stream = [0.0] * n  # compute stream time per rank
    comm = [0.0] * n  # communication stream time per rank
    step_ends: list[list[float]] = []

    def vary(seconds: float) -> float:
        return seconds * (1.0 + rng.uniform(-job.jitter, job.jitter))

    for step in range(job.steps):
        ops = [Profile(vary(p.forward), vary(p.backward), vary(p.optimizer)) for p in job.ranks]
        ddp = job.mode == "ddp"
        marks = _ddp_step(job, ops, stream, comm) if ddp else _plain_step(job, ops, stream)
        step_ends.append(list(stream))
        for r, view in enumerate(views):
            view.true_compute.append(ops[r].forward + ops[r].backward + ops[r].optimizer)
            _replay(job, view, marks[r], step_ends, step)
    return SimResult(views, step_ends)


def _ddp_step(job: SimJob, ops: list[Profile], stream: list[float], comm: list[float],
              ) -> list[dict[str, float]]:
    n, k = len(ops), job.buckets
    fwd_end = [stream[r] + ops[r].forward for r in range(n)]
    bucket_end = 0.0
    for b in range(k):
        arrive = [max(fwd_end[r] + (b + 1) / k * ops[r].backward, comm[r]) for r in range(n)]
        bucket_end = max(arrive) + job.transfer  # finishes when the last rank has arrived
        comm[:] = [bucket_end] * n
    marks = []
    for r in range(n):
        compute_end = fwd_end[r] + ops[r].backward
        backward_end = max(compute_end, bucket_end)
        stream[r] = backward_end + ops[r].optimizer
        marks.append({"grad_ready": compute_end, "backward_end": backward_end,
                      "step_end": stream[r]})
    return marks


def _plain_step(job: SimJob, ops: list[Profile], stream: list[float]) -> list[dict[str, float]]:
    n = len(ops)
    marks: list[dict[str, float]] = [{} for _ in range(n)]
    for phase, name in (("forward", "ar1"), ("backward", "ar2")):
        arrive = [stream[r] + getattr(ops[r], phase) for r in range(n)]
        end = max(arrive) + job.transfer
        for r in range(n):
            marks[r][f"{name}_begin"] = arrive[r]
            marks[r][f"{name}_end"] = end
            stream[r] = end
    for r in range(n):
        stream[r] += ops[r].optimizer
        marks[r]["step_end"] = stream[r]
    return marks


def _replay(job: SimJob, view: RankView, marks: dict[str, float], step_ends: list[list[float]],
            step: int) -> None:
    """The host side of one rank's step, as the hook's callbacks would run it."""
    src, timer, r = view.source, view.timer, view.rank
    behind = step - job.lead  # the device has reached the end of this step when the host looks
    src.now = step_ends[behind][r] if behind >= 0 else -1.0
    if job.mode == "ddp":
        src.cursor = marks["grad_ready"]
        timer.grad_ready()  # DdpProbe: post-accumulate-grad hook of the last-ready parameter
        src.cursor = marks["backward_end"]
        window = timer.backward_end()  # DdpProbe: autograd final callback behind DDP's
        assert window is not None
        view.tracker.ddp_reduction("dp", 1 << 20, *window)
    else:
        for name in ("ar1", "ar2"):
            src.cursor = marks[f"{name}_begin"]
            _sync_all_reduce(view, marks[f"{name}_end"])
    src.cursor = marks["step_end"]
    view.measured.extend(timer.step_end(host_seconds=0.0))


def _sync_all_reduce(view: RankView, end: float) -> None:
    """A sync `dist.all_reduce` through the hook's own wrapper; the call leaves the compute
    stream waiting for the collective, so the next mark lands at its end."""

    def all_reduce(*args: object, **kwargs: object) -> None:
        view.source.cursor = end

    wrap_call(view.tracker, "all_reduce", "all_reduce", all_reduce)(None)


def online_estimate(result: SimResult, skip: int = 2) -> dict[str, Any]:
    """The alert rules' straggler formulas over the measured means of each rank.

    compute ratio = rank's mean compute / median rank's (SlowRank); `vs_others`: / the median
    of the other ranks'; S = median step / (median compute + the least blocked time)
    (run:robust_straggler_slowdown:ratio5m).
    """
    means = []
    for view in result.views:
        rows = view.measured[skip:]
        step = statistics.fmean(s for s, _ in rows)
        blocked = statistics.fmean(b for _, b in rows)
        means.append((step, step - blocked, blocked))
    median_compute = statistics.median(c for _, c, _ in means)
    ratios = [c / median_compute for _, c, _ in means]
    slowdown = statistics.median(s for s, _, _ in means) / (
        median_compute + min(b for _, _, b in means))
    computes = [c for _, c, _ in means]
    vs_others = [c / statistics.median(computes[:r] + computes[r + 1:])
                 for r, c in enumerate(computes)]
    return {"ratios": ratios, "vs_others": vs_others, "slowdown": slowdown,
            "named": max(range(len(ratios)), key=ratios.__getitem__)}


# -- fsdp and pp: ranks as programs of host calls, through the hook's own wrappers ---------------
Program = Generator[tuple[Any, ...], float, None]


@dataclass(frozen=True)
class SimGroup:
    """A process group as the hook labels it."""

    group_desc: str


FSDP_GROUP, PP_GROUP, DP_GROUP = SimGroup("fsdp"), SimGroup("pp"), SimGroup("dp")


@dataclass(frozen=True)
class SimOptions:
    """The options torch hands a process group's coalesced method (`AllgatherOptions`, ...)."""

    asyncOp: bool  # torch's name


class SimWork:
    """A `Work` of an isend/irecv; on NCCL its future completes at enqueue."""

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.end = 0.0  # when the message completes, known once both ends reached it

    def get_future(self) -> SimWork:
        return self

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        callback(self)


class Fabric:
    """What ranks meet in: collectives end `transfer` after the last rank's stream reached them,
    a message `transfer` after both its send and its receive were reached."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.arrivals: dict[tuple[Any, ...], list[float]] = {}
        self.transfers: dict[tuple[Any, ...], float] = {}
        self.sent: dict[tuple[int, int], list[float]] = {}
        self.received: dict[tuple[int, int], list[float]] = {}

    def arrive(self, key: tuple[Any, ...], time: float, transfer: float) -> None:
        self.arrivals.setdefault(key, []).append(time)
        self.transfers[key] = transfer

    def send(self, src: int, dst: int, time: float, transfer: float) -> tuple[Any, ...]:
        return self._post(self.sent, src, dst, time, transfer)

    def receive(self, src: int, dst: int, time: float, transfer: float) -> tuple[Any, ...]:
        return self._post(self.received, src, dst, time, transfer)

    def _post(self, side: dict[tuple[int, int], list[float]], src: int, dst: int, time: float,
              transfer: float) -> tuple[Any, ...]:
        posted = side.setdefault((src, dst), [])
        posted.append(time)
        key = ("message", src, dst, len(posted) - 1)
        self.transfers[key] = transfer
        return key

    def end(self, key: tuple[Any, ...]) -> float | None:
        if key[0] == "message":
            _, src, dst, k = key
            sent, received = self.sent.get((src, dst), []), self.received.get((src, dst), [])
            if k >= len(sent) or k >= len(received):
                return None
            return max(sent[k], received[k]) + self.transfers[key]
        arrived = self.arrivals.get(key, [])
        if len(arrived) < self.ranks:
            return None
        return max(arrived) + self.transfers[key]


class SimRank:
    """One rank's device streams and the hook's wrappers around fakes that move them."""

    def __init__(self, view: RankView, fabric: Fabric, job: SimJob) -> None:
        self.view, self.src, self.fabric, self.job = view, view.source, fabric, job
        tracker = view.tracker
        self.ends: list[float] = []  # the compute stream's time at each step end
        self._end = 0.0  # when the collective being called completes
        self._work: SimWork | None = None
        self.stall = 0.0  # the compute stream's waits in this step
        self.compute_seconds = 0.0
        self.all_gather_single = wrap_call(tracker, "all_gather_single", "all_gather", self._sync)
        self.reduce_scatter_single = wrap_call(tracker, "reduce_scatter_single", "reduce_scatter",
                                                  self._sync)
        self.isend = wrap_call(tracker, "isend", "send", self._isend)
        self.irecv = wrap_call(tracker, "irecv", "recv", self._irecv)
        self.wait = wrap_wait(tracker, self._wait)
        self.record_event = streams.wrap_record_event(tracker, self._record_event)
        self.wait_event = streams.wrap_wait_event(tracker, self._wait_event)
        # Megatron-core: per-bucket calls inside `_coalescing_manager`, and the process group's
        # coalesced methods its block's end calls
        self.bucket_calls = {op: wrap_call(tracker, name, op, self._record) for name, op in (
            ("all_reduce", "all_reduce"), ("reduce_scatter_tensor", "reduce_scatter"),
            ("all_gather_into_tensor", "all_gather"))}
        self.coalesced_calls = {op: wrap_coalesced(tracker, op, self._coalesced)
                                for op in ("all_reduce", "reduce_scatter", "all_gather")}
        self.comm_end = 0.0  # when NCCL's stream finishes the last collective waited for

    # -- the fakes: what CUDA and NCCL do to the streams' times ------------------------------
    def _sync(self, output: Any, input: Any, op: Any = None, group: Any = None,
              async_op: bool = False) -> None:
        self.src.cursor = max(self.src.cursor, self._end)  # the stream waits for the collective

    def _isend(self, tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
               group_dst: int | None = None) -> SimWork | None:
        return self._work

    def _irecv(self, tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
               group_src: int | None = None) -> SimWork | None:
        return self._work

    def _record(self, *args: Any, group: Any = None, async_op: bool = False) -> None:
        """A collective called inside `_coalescing_manager`: torch records the op, issues
        nothing, and returns a placeholder work (None here)."""
        c10d._world.pg_coalesce_state[group].append(args)

    def _coalesced(self, pg: Any, *args: Any) -> SimWork | None:
        assert self._work is not None
        if not args[-1].asyncOp:  # NCCL: a sync collective on the current stream
            self._advance(self.src.current, self._work.end)
        return self._work

    def _wait(self, work: SimWork, timeout: Any = None) -> bool:
        self._advance(self.src.current, work.end)
        return True

    def _record_event(self, stream: str, event: Any = None) -> SimEvent:
        return SimEvent(self.src.streams[stream])

    def _wait_event(self, stream: str, event: SimEvent) -> None:
        self._advance(stream, event.time)

    def _advance(self, stream: str, time: float) -> None:
        before = self.src.streams[stream]
        if time > before:
            self.src.streams[stream] = time
            if stream == COMPUTE:
                self.stall += time - before

    # -- what FSDP2 and the pipeline schedules call --------------------------------------------
    def compute(self, seconds: float) -> None:
        self.src.streams[COMPUTE] += seconds
        self.compute_seconds += seconds

    def wait_stream(self, waiting: str, other: str) -> None:
        """`Stream.wait_stream`: `waiting.wait_event(other.record_event())`."""
        self.wait_event(waiting, self.record_event(other))

    def plain_event(self) -> SimEvent:
        """`Event().record()` on the compute stream (FSDP2's copy-out event)."""
        return SimEvent(self.src.streams[COMPUTE])

    def collective(self, fn: Callable[..., Any], stream: str, key: tuple[Any, ...],
                   transfer: float) -> Generator[tuple[Any, ...], float, SimEvent]:
        """A sync collective called while `stream` is current, then `stream.record_event()`."""
        self.src.current = stream
        self.fabric.arrive(key, self.src.cursor, transfer)
        self._end = yield key
        fn(None, None, group=FSDP_GROUP)
        event = self.record_event(stream)
        self.src.current = COMPUTE
        return event

    def post(self, peer: int, send: bool) -> SimWork:
        """`isend`/`irecv` to/from `peer` (global ranks) on the compute stream."""
        me, transfer, now = self.view.rank, self.job.transfer, self.src.cursor
        if send:
            self._work = SimWork(self.fabric.send(me, peer, now, transfer))
            work = self.isend(None, dst=peer, group=PP_GROUP)
        else:
            self._work = SimWork(self.fabric.receive(peer, me, now, transfer))
            work = self.irecv(None, src=peer, group=PP_GROUP)
        assert work is self._work
        return work

    def coalesced(self, op: str, key: tuple[Any, ...], buckets: int) -> SimWork:
        """`with _coalescing_manager(group, async_ops=True) as cm:` one call per bucket, issued
        at the block's end as one collective on NCCL's stream, from the compute stream's time
        now; returns the work `cm.wait()` waits on."""
        self.fabric.arrive(key, self.src.streams[COMPUTE], self.job.transfer)
        return self._issue(op, SimWork(key), buckets, async_op=True)

    def coalesced_sync(self, op: str, key: tuple[Any, ...], buckets: int) -> Program:
        """`with _coalescing_manager(group, async_ops=False):` the same block, run on the
        compute stream, then torch's wait on its work."""
        self.fabric.arrive(key, self.src.streams[COMPUTE], self.job.transfer)
        end = yield key
        work = SimWork(key)
        work.end = self.comm_end = max(end, self.comm_end + self.job.transfer)
        self.wait(self._issue(op, work, buckets, async_op=False))

    def _issue(self, op: str, work: SimWork, buckets: int, async_op: bool) -> SimWork:
        state = c10d._world.pg_coalesce_state
        state[DP_GROUP] = []
        try:
            for _ in range(buckets):
                self.bucket_calls[op](None, None, group=DP_GROUP, async_op=async_op)
        finally:
            recorded = state.pop(DP_GROUP)
        assert len(recorded) == buckets
        self._work = work
        issued = self.coalesced_calls[op](DP_GROUP, recorded, SimOptions(async_op))
        assert issued is work
        return work

    def wait_in_order(self, work: SimWork) -> Program:
        """`cm.wait()`: the compute stream waits for the work, which NCCL's stream ran after
        the collective before it (works are waited for in the order they were issued)."""
        end = yield work.key
        work.end = self.comm_end = max(end, self.comm_end + self.fabric.transfers[work.key])
        self.wait(work)

    def wait_all(self, works: list[SimWork]) -> Program:
        for work in works:
            work.end = yield work.key
            self.wait(work)

    def step_end(self, step: int) -> None:
        """The optimizer's step hook: the step's marks are read when the device reached them."""
        view, src = self.view, self.src
        behind = step - self.job.lead
        src.now = self.ends[behind] if behind >= 0 else -1.0
        read = view.timer.step_end(host_seconds=0.0)
        view.measured.extend(read)
        view.reads.append(len(read))
        self.ends.append(src.streams[COMPUTE])
        view.true_compute.append(self.compute_seconds)
        view.true_blocked.append(self.stall)
        self.compute_seconds = self.stall = 0.0


def _simulate_streams(job: SimJob) -> SimResult:
    rng = random.Random(job.seed)
    n = len(job.ranks)

    def vary(seconds: float) -> float:
        return seconds * (1.0 + rng.uniform(-job.jitter, job.jitter))

    ops = [[Profile(vary(p.forward), vary(p.backward), vary(p.optimizer)) for p in job.ranks]
           for _ in range(job.steps)]
    fabric = Fabric(n)
    ranks = []
    for rank in range(n):
        source = SimSource(job.legacy)
        timer = StepTimer(source)
        view = RankView(rank, source, timer, CollectiveTracker(_errors, timer))
        ranks.append(SimRank(view, fabric, job))
    program = {"fsdp": _fsdp_rank, "pp": _pp_rank, "megatron": _megatron_rank}[job.mode]
    _run(fabric, [program(job, sim, [row[sim.view.rank] for row in ops]) for sim in ranks])
    step_ends = [[sim.ends[step] for sim in ranks] for step in range(job.steps)]
    return SimResult([sim.view for sim in ranks], step_ends)


def _run(fabric: Fabric, programs: list[Program]) -> None:
    """Advance each rank's program until it needs what a peer has not reached yet."""
    get_rank = dist.get_rank
    waiting: list[tuple[Any, ...] | None] = [None] * len(programs)
    alive = set(range(len(programs)))
    current = [0]
    dist.get_rank = lambda *args, **kwargs: current[0]  # type: ignore[assignment]
    try:
        for rank, program in enumerate(programs):
            current[0] = rank
            waiting[rank] = next(program)
        while alive:
            progressed = False
            for rank in sorted(alive):
                key = waiting[rank]
                assert key is not None
                end = fabric.end(key)
                if end is None:
                    continue
                current[0] = rank
                progressed = True
                try:
                    waiting[rank] = programs[rank].send(end)
                except StopIteration:
                    alive.discard(rank)
            if not progressed:
                raise RuntimeError(f"simulated ranks wait for each other: {waiting}")
    finally:
        dist.get_rank = get_rank  # type: ignore[assignment]


def _fsdp_rank(job: SimJob, sim: SimRank, steps: list[Profile]) -> Program:
    """One rank of FSDP2: `fully_shard` on each of `job.layers` layers, sync all-gathers on the
    all-gather stream, reduce-scatters on theirs (torch/distributed/fsdp/_fully_shard)."""
    layers, gather, scatter = job.layers, sim.all_gather_single, sim.reduce_scatter_single
    for step, ops in enumerate(steps):
        forward, backward = ops.forward / layers, ops.backward / layers
        sim.wait_stream(ALL_GATHER, COMPUTE)  # root pre-forward: wait for the optimizer
        copied_out: SimEvent | None = None
        for i in range(layers):  # pre_forward: unshard, then wait_for_unshard
            event = yield from sim.collective(gather, ALL_GATHER, ("ag", step, "fwd", i),
                                              job.transfer)
            if copied_out is not None:  # free the previous result after its copy-out
                sim.wait_event(ALL_GATHER, copied_out)
            sim.wait_event(COMPUTE, event)  # foreach_all_gather_copy_out
            copied_out = sim.plain_event()
            sim.compute(forward)
        assert copied_out is not None
        sim.wait_event(ALL_GATHER, copied_out)  # root post-forward
        prefetched: dict[int, SimEvent] = {}
        in_flight: list[SimEvent] = []  # reduce-scatter buffers (at most one)
        for i in reversed(range(layers)):
            if job.reshard:  # pre_backward: unshard (unless prefetched), wait, prefetch
                if i not in prefetched:
                    prefetched[i] = yield from sim.collective(
                        gather, ALL_GATHER, ("ag", step, "bwd", i), job.transfer)
                sim.wait_event(COMPUTE, prefetched.pop(i))
                sim.wait_event(ALL_GATHER, sim.plain_event())
                if i > 0:
                    prefetched[i - 1] = yield from sim.collective(
                        gather, ALL_GATHER, ("ag", step, "bwd", i - 1), job.transfer)
            sim.compute(backward)
            while in_flight:  # post_backward: recycle the previous reduce-scatter's buffer
                sim.wait_event(COMPUTE, in_flight.pop(0))
            sim.wait_stream(REDUCE_SCATTER, COMPUTE)  # foreach_reduce
            in_flight.append((yield from sim.collective(
                scatter, REDUCE_SCATTER, ("rs", step, i), job.reduce_scatter)))
        for event in in_flight:  # the root's post-backward final callback
            sim.wait_event(COMPUTE, event)
        sim.compute(ops.optimizer)
        sim.step_end(step)


def _pp_rank(job: SimJob, sim: SimRank, steps: list[Profile]) -> Program:
    """One pipeline stage per rank under GPipe or 1F1B (torch/distributed/pipelining)."""
    stage, stages, m = sim.view.rank, len(job.ranks), job.microbatches
    first, last = stage == 0, stage == stages - 1

    def fwd_recv() -> list[SimWork]:
        return [] if first else [sim.post(stage - 1, send=False)]

    def fwd_send() -> list[SimWork]:
        return [] if last else [sim.post(stage + 1, send=True)]

    def bwd_recv() -> list[SimWork]:
        return [] if last else [sim.post(stage + 1, send=False)]

    def bwd_send() -> list[SimWork]:
        return [] if first else [sim.post(stage - 1, send=True)]

    for step, ops in enumerate(steps):
        forward, backward = ops.forward / m, ops.backward / m
        if job.schedule == "gpipe":
            sends: list[SimWork] = []
            for _ in range(m):
                yield from sim.wait_all(fwd_recv())
                sim.compute(forward)
                sends += fwd_send()
            yield from sim.wait_all(sends)
            sends = []
            for _ in range(m):
                yield from sim.wait_all(bwd_recv())
                sim.compute(backward)
                sends += bwd_send()
            yield from sim.wait_all(sends)
        else:
            yield from _one_f_one_b(sim, m, stages - stage, forward, backward,
                                    (fwd_recv, fwd_send, bwd_recv, bwd_send))
        sim.compute(ops.optimizer)
        sim.step_end(step)


def _one_f_one_b(sim: SimRank, m: int, warmup: int, forward: float, backward: float,
                 posts: tuple[Callable[[], list[SimWork]], ...]) -> Program:
    """Schedule1F1B._step_microbatches: warm-up forwards, then one backward and one forward
    with their sends and receives fused, then the remaining backwards."""
    fwd_recv, fwd_send, bwd_recv, bwd_send = posts
    warmup = min(m, warmup)
    send_work: list[SimWork] = []
    pending_fwd_send = False
    for k in range(warmup):
        yield from sim.wait_all(fwd_recv())
        sim.compute(forward)
        yield from sim.wait_all(send_work)
        send_work = []
        if k != warmup - 1:
            send_work = fwd_send()
        else:
            pending_fwd_send = True  # fused with the first backward's receive
    forwards, backwards = warmup, 0
    while True:
        batch = (fwd_send() if pending_fwd_send else []) + bwd_recv()
        pending_fwd_send = False
        yield from sim.wait_all(batch)
        sim.compute(backward)
        backwards += 1
        if forwards == m:
            break
        yield from sim.wait_all(bwd_send() + fwd_recv())
        sim.compute(forward)
        pending_fwd_send = True
        forwards += 1
    send_work = bwd_send()
    while backwards < m:
        yield from sim.wait_all(bwd_recv())
        sim.compute(backward)
        yield from sim.wait_all(send_work)
        send_work = bwd_send()
        backwards += 1
    yield from sim.wait_all(send_work)


def _megatron_rank(job: SimJob, sim: SimRank, steps: list[Profile]) -> Program:
    """One data-parallel rank of Megatron-core 0.16.1 (distributed/param_and_grad_buffer.py
    `_ParamAndGradBucketGroup`, distributed_data_parallel.py hooks, optimizer/distrib_optimizer.py
    `step_with_ready_grads`): one bucket group per layer, `job.buckets` buckets in each."""
    layers, reduce_op = job.layers, "reduce_scatter" if job.dist_opt else "all_reduce"
    gathers: dict[int, SimWork] = {}  # layer -> its all-gather in flight (overlap_param_gather)
    for step, ops in enumerate(steps):
        forward, backward = ops.forward / layers, ops.backward / layers
        for i in range(layers):
            if job.dist_opt and job.overlap_param_gather:  # forward pre-hook: finish_param_sync
                if i not in gathers:
                    gathers[i] = sim.coalesced("all_gather", ("ag", step, i), job.buckets)
                yield from sim.wait_in_order(gathers.pop(i))
                if i + 1 < layers:
                    gathers[i + 1] = sim.coalesced("all_gather", ("ag", step, i + 1),
                                                   job.buckets)
            sim.compute(forward)
        reductions: list[SimWork] = []
        for i in reversed(range(layers)):  # buckets ready in backward order
            sim.compute(backward)
            if step > 0:  # register_grad_ready: the group's last gradient issues its reduction
                reductions.append(sim.coalesced(reduce_op, ("grad", step, i), job.buckets))
        for i in reversed(range(layers)):  # finish_grad_sync, group by group: cm.wait()
            if step == 0:  # is_first_batch: the group's reduction is issued here
                reductions.append(sim.coalesced(reduce_op, ("grad", step, i), job.buckets))
            yield from sim.wait_in_order(reductions.pop(0))
        sim.compute(ops.optimizer)
        sim.step_end(step)  # the inner torch optimizer's step: the hook's step end
        if job.dist_opt and not job.overlap_param_gather:  # start_param_sync, synchronous
            for i in range(layers):
                yield from sim.coalesced_sync("all_gather", ("ag", step, i), job.buckets)
