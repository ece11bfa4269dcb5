"""A discrete-event simulation of N data-parallel ranks on GPUs, driving the hook's own estimator.

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
  `transfer` after the last rank arrives, the compute stream waiting for it.

The hook's estimator sees the simulation only through the `TimingSource` boundary: a mark is an
event at the compute stream's current time, reached once the device has got there. The same
`StepTimer` and `CollectiveTracker` code as on a real rank turns marks into step and blocked
seconds; `online_estimate` then applies the alert rules' formulas (alert_rules/stragglers.yml).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace

from robust_metrics.hooks.collectives import CollectiveTracker
from robust_metrics.hooks.timing import StepTimer

__all__ = ["Profile", "SimJob", "SimSource", "online_estimate", "simulate"]


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
    mode: str = "ddp"  # or "plain"
    buckets: int = 4
    transfer: float = 0.004  # seconds per bucket all-reduce (ddp) or per plain all-reduce
    steps: int = 40
    jitter: float = 0.02  # each op's duration varies uniformly by +-jitter
    lead: int = 1  # steps the host runs ahead of its device
    seed: int = 0

    def ideal(self) -> SimJob:
        """Every rank's ops at the mean over ranks (the what-if method's ideal compute)."""
        n = len(self.ranks)
        mean = Profile(*(sum(getattr(p, f) for p in self.ranks) / n
                         for f in ("forward", "backward", "optimizer")))
        return replace(self, ranks=(mean,) * n)


@dataclass(frozen=True)
class SimMark:
    time: float


class SimSource:
    """The `TimingSource` boundary for one simulated rank: events on its compute stream."""

    host = False

    def __init__(self) -> None:
        self.cursor = 0.0  # the compute stream's time at the op being enqueued
        self.now = 0.0  # how far the device has got when the host looks
        self.early_reads = 0

    def mark(self) -> SimMark:
        return SimMark(self.cursor)

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

    view.tracker._wrap("all_reduce", "all_reduce", all_reduce)(None)


def online_estimate(result: SimResult, skip: int = 2) -> dict[str, object]:
    """The alert rules' straggler formulas over the measured means of each rank.

    compute ratio = rank's mean compute / median rank's (SlowRank); S = median step /
    (median compute + the least blocked time) (run:robust_straggler_slowdown:ratio5m).
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
    return {"ratios": ratios, "slowdown": slowdown,
            "named": max(range(len(ratios)), key=ratios.__getitem__)}
