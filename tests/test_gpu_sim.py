"""The GPU timing path proved by simulation: N ranks on GPUs (tests/gpu_sim.py) drive the hook's
own StepTimer and CollectiveTracker through the TimingSource boundary, as CUDA events would."""

from __future__ import annotations

import pytest

from tests.gpu_sim import Profile, SimJob, online_estimate, simulate

RANKS, SLOW = 16, 5
BASE = Profile(forward=0.030, backward=0.060, optimizer=0.010)


def job(mode: str, phase: str | None, **kw: object) -> SimJob:
    ranks = [BASE] * RANKS
    if phase is not None:
        ranks[SLOW] = BASE.scaled(phase, 1.3)  # the rank computes 1.3x, the excess in `phase`
    return SimJob(tuple(ranks), mode=mode, **kw)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("mode", ["ddp", "plain"])
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
