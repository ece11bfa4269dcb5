"""The step windows the hook keeps for the straggler rules (robust_metrics/hooks/windows.py):
the means over the steps that ended within a window before the rank's last step, on the rank's
clock. What `watch()` publishes from them, and through which sinks: tests/test_hook.py."""

from __future__ import annotations

import math
import time

import pytest
import torch

import robust_metrics
from robust_metrics.hooks.config import WatchOptions
from robust_metrics.hooks.windows import StepWindows
from tests.hook_models import make_model, value


def steps_every(seconds: float, count: int, computes: list[float]) -> StepWindows:
    """`count` steps of `seconds` each ending at t = seconds, 2 x seconds, ..., their computes
    cycling through `computes`."""
    windows = StepWindows()
    for i in range(count):
        windows.add((i + 1) * seconds, seconds, computes[i % len(computes)])
    return windows


def test_a_window_holds_the_steps_that_ended_within_it_before_the_last_step() -> None:
    windows = steps_every(1.0, 600, [0.2, 0.4])  # steps end at 1 .. 600 s
    minute = windows.stats("1m")
    assert minute is not None
    assert minute.steps == 60  # ended in (540, 600]
    assert minute.duration_mean == pytest.approx(1.0)
    assert minute.compute_mean == pytest.approx(0.3)
    assert minute.compute_variation == pytest.approx(0.1 / 0.3)  # stddev 0.1 around 0.3
    five = windows.stats("5m")
    assert five is not None and five.steps == 300


def test_a_window_after_a_change_mixes_the_old_and_new_steps_by_their_end_times() -> None:
    windows = StepWindows()
    for i in range(120):  # one 0.5 s compute per second, then 1.0 s from t = 90 s on
        windows.add(i + 1.0, 1.0, 0.5 if i + 1 <= 90 else 1.0)
    minute = windows.stats("1m")  # (60, 120]: 30 steps of 0.5, 30 of 1.0
    assert minute is not None and minute.compute_mean == pytest.approx(0.75)
    two = windows.stats("2m")  # every step since the process began: 90 x 0.5, 30 x 1.0
    assert two is not None and two.steps == 120
    assert two.compute_mean == pytest.approx((90 * 0.5 + 30 * 1.0) / 120)


def test_windows_end_at_the_last_step_so_a_rank_that_stops_keeps_its_values() -> None:
    windows = steps_every(1.0, 100, [0.3])
    before = windows.stats("1m")
    time.sleep(0.01)  # time passes with no step: nothing the window reads changes
    assert windows.stats("1m") == before
    assert windows.last_step == 100.0


def test_no_window_before_the_first_step_and_one_step_is_a_window() -> None:
    windows = StepWindows()
    assert windows.stats("1m") is None and windows.last_step is None
    windows.add(10.0, 2.0, 1.5)
    only = windows.stats("1m")
    assert only is not None
    assert (only.steps, only.duration_mean, only.compute_mean) == (1, 2.0, 1.5)
    assert only.compute_variation == 0.0


def test_trim_keeps_memory_to_the_longest_window_and_the_values_unchanged() -> None:
    windows = steps_every(0.01, 100_000, [0.004, 0.006])  # 1,000 s of 10 ms steps
    expected = {name: windows.stats(name) for name in windows.lengths}
    windows.trim()
    assert len(windows._marks) <= 300 / 0.01 + 2
    assert {name: windows.stats(name) for name in windows.lengths} == expected


def test_memory_stays_bounded_when_nothing_reads_the_windows() -> None:
    windows = StepWindows(time_scale=1 / 15)  # 5 minutes: 20 s
    for i in range(200_000):  # 10 ms steps, 2,000 s, never read
        windows.add(i * 0.01, 0.01, 0.005)
    assert len(windows._marks) <= 2 * (20 / 0.01) + 4096 + 2
    stats = windows.stats("5m")
    assert stats is not None and stats.steps == 2000


def test_the_time_scale_scales_every_window() -> None:
    windows = StepWindows(time_scale=1 / 15)
    assert windows.lengths == {"1m": 4.0, "2m": 8.0, "5m": 20.0}
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match="time_scale"):
            StepWindows(time_scale=bad)


def test_the_time_scale_comes_from_the_environment_and_bad_values_are_refused() -> None:
    env = {"ROBUST_METRICS_TIME_SCALE": "0.0667"}
    assert WatchOptions.resolve(env, backend="null").time_scale == pytest.approx(0.0667)
    assert WatchOptions.resolve({}, backend="null").time_scale == 1.0
    with pytest.raises(ValueError, match="ROBUST_METRICS_TIME_SCALE"):
        WatchOptions.resolve({"ROBUST_METRICS_TIME_SCALE": "fast"}, backend="null")
    for bad in (0, -2, math.inf, True):
        with pytest.raises(ValueError, match="time_scale"):
            WatchOptions.resolve({}, backend="null", time_scale=bad)


def test_the_first_step_of_a_process_and_after_a_phase_is_left_out_of_the_windows() -> None:
    """A restarted job's windows must not be its first, partial step alone: timed from the first
    forward, it misses the wait before it (data, a sleep after the optimizer step), and a
    threshold on the window's mean (badput's 2 median step times) would shrink with it."""
    model, optimizer = make_model()
    handle = robust_metrics.watch(model, optimizer, backend="null", run="unit", rank=0,
                                  world_size=1)
    try:
        def steps(count: int) -> None:
            for _ in range(count):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                time.sleep(0.05)  # after the step, as a job that waits for its next batch

        steps(3)
        mean = value(handle, "robust_step_duration_mean_seconds", window="5m")
        assert value(handle, "robust_window_steps", window="1m") == 2
        assert mean >= 0.05, mean  # full steps only: each holds the wait
        handle.phase("checkpoint")
        time.sleep(0.2)
        handle.phase("train")
        steps(2)  # the first after the checkpoint is partial too
        assert value(handle, "robust_window_steps", window="1m") == 3
        assert value(handle, "robust_step_duration_mean_seconds", window="5m") >= 0.05
    finally:
        handle.close()
