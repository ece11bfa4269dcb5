"""The GPU timing path proved by simulation: N ranks on GPUs (tests/gpu_sim.py) drive the hook's
own StepTimer and CollectiveTracker through the TimingSource boundary, as CUDA events would.

What no simulation shows, only a real GPU can (`gpu`-marked tests in
tests/integration/test_parallelism_gpu.py, and scripts/gpu-check): that torch and NCCL issue and
wait as modelled here, that events recorded by the hook land where the model puts them, compute
slowed by communication kernels sharing the GPU, and the hook's own cost on the device.
"""

from __future__ import annotations

import statistics

import pytest

from tests.gpu_sim import Profile, SimJob, online_estimate, simulate

RANKS, SLOW, STAGES = 16, 5, 4
BASE = Profile(forward=0.030, backward=0.060, optimizer=0.010)
# FSDP2 with and without resharding after forward; one pipeline stage per rank, two schedules
STACKS: dict[str, dict[str, object]] = {
    "fsdp": {"mode": "fsdp"},
    "fsdp-no-reshard": {"mode": "fsdp", "reshard": False},
    "pp-gpipe": {"mode": "pp", "schedule": "gpipe"},
    "pp-1f1b": {"mode": "pp", "schedule": "1f1b"},
}


def job(mode: str, phase: str | None, **kw: object) -> SimJob:
    n = STAGES if mode == "pp" else RANKS
    slow = 1 if mode == "pp" else SLOW
    ranks = [BASE] * n
    if phase is not None:
        ranks[slow] = BASE.scaled(phase, 1.3)  # the rank computes 1.3x, the excess in `phase`
    return SimJob(tuple(ranks), mode=mode, **kw)  # type: ignore[arg-type]


def stack(name: str, phase: str | None, **kw: object) -> SimJob:
    options = {**STACKS[name], **kw}
    return job(str(options.pop("mode")), phase, **options)


def slow_rank(name: str) -> int:
    return 1 if STACKS[name]["mode"] == "pp" else SLOW


@pytest.mark.parametrize("mode", ["ddp", "plain"])
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_a_straggler_is_named_whichever_phase_is_slow(mode: str, phase: str) -> None:
    estimate = online_estimate(simulate(job(mode, phase)))
    ratios = estimate["ratios"]
    assert estimate["named"] == SLOW
    assert ratios[SLOW] == pytest.approx(1.3, abs=0.02)  # > SlowRank's 1.25
    assert all(abs(r - 1.0) < 0.02 for i, r in enumerate(ratios) if i != SLOW), ratios


@pytest.mark.parametrize("mode", ["ddp", "plain"])
def test_a_balanced_run_has_no_straggler(mode: str) -> None:
    estimate = online_estimate(simulate(job(mode, None)))
    assert max(estimate["ratios"]) < 1.05  # SlowRank needs 1.25
    assert estimate["slowdown"] < 1.03  # below the what-if method's attribution threshold


@pytest.mark.parametrize("mode", ["ddp", "plain", "fsdp"])
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer", None])
def test_slowdown_is_within_5_percent_of_the_simulated_truth(mode: str, phase: str | None) -> None:
    """S estimated online from the marks, against the simulation's own T_actual / T_ideal (ideal:
    every rank's ops at the mean over ranks, as in the what-if method)."""
    actual = job(mode, phase)
    result = simulate(actual)
    truth = result.mean_step() / simulate(actual.ideal()).mean_step()
    estimate = online_estimate(result)["slowdown"]
    assert estimate == pytest.approx(truth, rel=0.05), (estimate, truth)


def test_buckets_overlap_backward_and_only_the_tail_is_blocked() -> None:
    """With communication overlapped by backward, an identical rank is blocked for the last
    bucket's transfer (2 ms), not for the whole reduction (8 buckets, 16 ms)."""
    result = simulate(job("ddp", None, buckets=8, transfer=0.002, jitter=0.0))
    blocked = [b for view in result.views for _, b in view.measured[1:]]  # 1st: no start mark
    assert blocked == pytest.approx([0.002] * len(blocked))


def test_marks_are_read_one_step_late_and_never_before_the_device_reaches_them() -> None:
    result = simulate(job("ddp", "backward", steps=10, lead=1))
    for view in result.views:
        assert view.source.early_reads == 0  # no read that would need a device synchronisation
        assert len(view.measured) == 9  # the last step's marks are not reached yet
        assert view.timer.dropped == 0


def test_a_device_far_behind_keeps_memory_bounded() -> None:
    result = simulate(job("ddp", None, steps=30, lead=12))
    view = result.views[0]
    assert view.source.early_reads == 0
    assert view.timer.dropped > 0 and len(view.measured) + view.timer.dropped <= 30


def test_the_host_clock_on_a_gpu_would_see_no_straggler() -> None:
    """Why the events: timing the same run on the host, where a collective returns at enqueue,
    gives every rank the same step and no blocked time, so no rank stands out."""
    result = simulate(job("ddp", "forward"))
    host_steps = [result.mean_step()] * RANKS  # every host follows the slowest device
    host_blocked = [0.0] * RANKS  # NCCL calls and their futures return at enqueue
    compute = [s - b for s, b in zip(host_steps, host_blocked, strict=True)]
    assert max(compute) == min(compute)
    measured = online_estimate(result)
    assert measured["named"] == SLOW


# -- FSDP2 and pipelines -------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(STACKS))
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_fsdp_and_pipeline_name_a_straggler_whichever_phase_is_slow(name: str, phase: str) -> None:
    """FSDP2 (16 ranks, sync all-gathers on their own stream with prefetch, reduce-scatters on
    theirs) and pipelines (4 stages, GPipe and 1F1B, P2P works waited on the compute stream): a
    rank 1.3x slower in one phase is named by its compute against the median of the others, no
    other rank moves. Proves the hook's split, from CUDA-event marks read a step late, is right
    for the way torch issues and waits for these collectives; a real GPU must show torch does."""
    estimate = online_estimate(simulate(stack(name, phase)))
    ratios, slow = estimate["vs_others"], slow_rank(name)
    assert estimate["named"] == slow
    assert ratios[slow] >= 1.2 and ratios[slow] == pytest.approx(1.3, abs=0.02), ratios
    assert all(r <= 1.1 for i, r in enumerate(ratios) if i != slow), ratios
    assert all(abs(r - 1.0) < 0.02 for i, r in enumerate(ratios) if i != slow), ratios


@pytest.mark.parametrize("name", list(STACKS))
def test_a_healthy_fsdp_or_pipeline_job_has_no_straggler(name: str) -> None:
    """Identical ranks (2% jitter per op): no rank above 1.1 of the others, though pipeline
    stages wait in their bubbles and FSDP2 ranks wait for the first all-gather and the last
    reduce-scatter of every step. Only a real GPU shows the noise of real kernels."""
    ratios = online_estimate(simulate(stack(name, None)))["vs_others"]
    assert max(ratios) <= 1.1 and max(ratios) < 1.02, ratios


@pytest.mark.parametrize("name", list(STACKS))
@pytest.mark.parametrize("phase", ["forward", None])
def test_fsdp_and_pipeline_compute_is_the_simulated_truth_step_by_step(
        name: str, phase: str | None) -> None:
    """Each step's measured blocked time is exactly the time the simulated compute stream
    stalled (waiting for an all-gather's or reduce-scatter's event, or a receive), so step minus
    blocked is the rank's compute, to the nanosecond, on every rank and step. Proves nothing
    overlapped (prefetched all-gathers, reduce-scatters under backward) is counted, and nothing
    the compute stream waited for is missed; a real GPU must show the events land there."""
    result = simulate(stack(name, phase))
    for view in result.views:
        # the last step is not read yet; the first is timed by the host (no start mark)
        rows = list(zip(view.measured, view.true_compute[:-1], view.true_blocked[:-1],
                        strict=True))[1:]
        assert len(rows) > 30
        for (seconds, blocked), compute, stalled in rows:
            assert blocked == pytest.approx(stalled, abs=1e-9)
            assert seconds - blocked == pytest.approx(compute, abs=1e-9)


@pytest.mark.parametrize("name", list(STACKS))
def test_fsdp_and_pipeline_steps_are_read_one_step_late_without_synchronising(name: str) -> None:
    """With the host one step ahead of its device, each step end reads exactly the step before,
    never an event the device has not reached (which would need a synchronisation) and drops
    none. A real GPU must show the host really runs ahead (scripts/gpu-check `nosync`)."""
    result = simulate(stack(name, "backward", steps=12, lead=1))
    for view in result.views:
        assert view.source.early_reads == 0
        assert view.reads == [0] + [1] * 11  # step k's marks are read at step k + 1's end
        assert view.timer.dropped == 0


def test_pipeline_sends_and_receives_count_per_pair_on_both_ends() -> None:
    """Through the real isend/irecv wrappers: each stage pair counts as many entered and
    completed on both ends (RankHang compares them)."""
    result = simulate(stack("pp-1f1b", None, steps=5))
    counts: dict[str, set[int]] = {}
    for view in result.views:
        _, entered, completed = view.tracker.snapshot()
        assert entered == completed
        for pair, count in entered.items():
            counts.setdefault(pair, set()).add(count)
    assert sorted(counts) == ["pp:0-1", "pp:1-2", "pp:2-3"]
    assert all(c == {40} for c in counts.values()), counts  # 4 micro-batches x 2 x 5 steps


def test_fsdp_overlap_marked_on_the_side_streams_hides_every_straggler() -> None:
    """The design before `hooks/collectives/streams.py`: blocked marked around each sync collective on the
    stream where it is issued. FSDP2 issues its all-gathers and reduce-scatters on their own
    streams, which run ahead of compute and wait there for peers, so those intervals overlap
    compute: a healthy rank reads about half its compute as blocked, and with one rank 1.3x
    slower in forward every other rank reads no compute at all, so no ratio means anything.
    Pipelines wait for their works on the compute stream and are unaffected. Counting instead
    where the compute stream waits for those streams' events (the fix) gives the truth above."""
    def mean_compute(result: object) -> list[float]:
        return [statistics.fmean(s - b for s, b in view.measured[2:])
                for view in result.views]  # type: ignore[attr-defined]

    def true_compute(result: object) -> list[float]:
        return [statistics.fmean(view.true_compute[2:-1])
                for view in result.views]  # type: ignore[attr-defined]

    healthy = simulate(stack("fsdp", None, legacy=True))
    for measured, truth in zip(mean_compute(healthy), true_compute(healthy), strict=True):
        assert measured < 0.6 * truth  # ~52 of 100 ms
    slowed = mean_compute(simulate(stack("fsdp", "forward", legacy=True)))
    assert [r for r, c in enumerate(slowed) if c > 0.005] == [SLOW]  # everyone else: ~0 ms
    fixed = mean_compute(simulate(stack("fsdp", None)))
    assert fixed == pytest.approx(true_compute(healthy), rel=0.002)
    pipeline = simulate(stack("pp-gpipe", "forward", legacy=True))
    assert mean_compute(pipeline) == pytest.approx(true_compute(pipeline), rel=0.002)
