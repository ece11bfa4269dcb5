"""The random series behind the statistical slow-rank cases, and the committed promtool file.

What the cases rely on: the series are what a hook would publish for the stated job (the window
gauges give back the jitter's spread and the slow rank's factor), a scenario is reproducible
from its seed, and alert_rules/tests/stragglers_stat_test.yml is what tests/straggler_stat_cases.py
generates (the promtool run in tests/test_rules.py judges it).
"""

from __future__ import annotations

import math
import statistics

import pytest

from robust_metrics import schema
from robust_metrics.hooks.windows import PUBLISHED, WINDOW_SECONDS
from robust_metrics.workloads.straggler_series import Scenario, promtool_series, run_steps, scrapes
from tests import straggler_stat_cases


def _minute(scenario: Scenario, rank: int, end_s: float) -> tuple[float, float]:
    """Mean and standard deviation of compute per step over the minute before the last step by
    `end_s`, from the window gauges as the rules read them: the mean, times its variation."""
    windows = scrapes(scenario)[int(end_s // 15)][rank].windows
    mean = windows[(schema.STEP_COMPUTE_MEAN.name, "1m")]
    return mean, mean * windows[(schema.STEP_COMPUTE_VARIATION.name, "1m")]


def test_the_window_gauges_are_the_hooks_over_the_steps_ended_by_the_scrape() -> None:
    """Each scrape serves, for every published window, the statistics of the steps that ended
    within it before the rank's last step by then (recomputed here from the steps themselves);
    nothing before the first step."""
    scenario = Scenario(ranks=2, minutes=6, slow={1: (1.2, 0.0)}, pause=(150.0, 200.0), seed=3)
    run = list(run_steps(scenario))
    table = scrapes(scenario)
    assert table[0][0].windows == {}
    for row in table[1:]:
        done = [step for step in run if step[0] <= row[0].t]
        last = done[-1][0]
        for scrape in row:
            expected = {}
            for spec, windows in PUBLISHED:
                for window in windows:
                    inside = [s for s in done if s[0] > last - WINDOW_SECONDS[window]]
                    computes = [s[2][scrape.rank] for s in inside]
                    expected[spec.name, window] = {
                        schema.STEP_COMPUTE_MEAN.name: statistics.fmean(computes),
                        schema.STEP_DURATION_MEAN.name: statistics.fmean(s[1] for s in inside),
                        schema.STEP_COMPUTE_VARIATION.name:
                            statistics.pstdev(computes) / statistics.fmean(computes),
                        schema.WINDOW_STEPS.name: len(inside),
                    }[spec.name]
            assert scrape.windows == pytest.approx(expected, rel=1e-9)
    # through the pause the windows keep the last step's values (they change only at step ends)
    assert table[11][1].windows == table[13][1].windows  # 165 s and 195 s
    assert table[11][1].windows[schema.WINDOW_STEPS.name, "1m"] > 50


def test_the_windows_give_back_the_jitter_and_the_slowdown() -> None:
    scenario = Scenario(ranks=4, minutes=20, slow={2: (1.1, 300.0)}, seed=11)
    for rank in (0, 1, 3):
        mean, spread = _minute(scenario, rank, 900)
        assert mean == pytest.approx(0.6, rel=0.03)
        assert spread == pytest.approx(0.6 * 0.1 / math.sqrt(3), rel=0.25)  # U(-10%, 10%)
    mean, _ = _minute(scenario, 2, 900)
    assert mean == pytest.approx(0.66, rel=0.03)
    early, _ = _minute(scenario, 2, 240)
    assert early == pytest.approx(0.6, rel=0.03)


def test_a_step_ends_when_the_slowest_rank_has_computed() -> None:
    """Bulk-synchronous: every rank takes the same steps, each as long as the slowest compute
    plus the transfer, so a slow rank slows the steps of all."""
    table = scrapes(Scenario(ranks=4, minutes=5, jitter=0.0, slow={1: (1.5, 0.0)}))
    last = table[-1]
    assert len({s.steps for s in last}) == 1
    assert last[0].duration / last[0].steps == pytest.approx(0.9 + 0.4)
    assert last[1].compute / last[1].steps == pytest.approx(0.9)
    assert last[0].compute / last[0].steps == pytest.approx(0.6)


def test_contention_moves_to_the_next_rank_every_period() -> None:
    scenario = Scenario(ranks=4, minutes=10, contention=(1.25, 60.0, 120.0))
    assert [scenario.slowdown(r, 30.0) for r in range(4)] == [1, 1, 1, 1]
    assert [scenario.slowdown(r, 130.0) for r in range(4)] == [1.25, 1, 1, 1]
    assert [scenario.slowdown(r, 190.0) for r in range(4)] == [1, 1.25, 1, 1]
    assert [scenario.slowdown(r, 370.0) for r in range(4)] == [1.25, 1, 1, 1]


def test_a_pause_takes_no_step_and_is_the_checkpoint_phase() -> None:
    table = scrapes(Scenario(ranks=2, minutes=6, pause=(120.0, 240.0)))
    steps = [row[0].steps for row in table]
    assert steps[9] == steps[15]  # 135 s and 225 s: nothing stepped in between
    assert steps[-1] > steps[16]
    assert [row[0].paused for row in table[7:17]] == [False] + [True] * 8 + [False]
    # the step after the pause does not include it (the hook restarts the step clock)
    assert table[-1][0].duration / table[-1][0].steps < 1.2


def test_a_scenario_is_the_same_from_its_seed() -> None:
    one = promtool_series(Scenario(ranks=3, minutes=3, seed=5), "r")
    assert one == promtool_series(Scenario(ranks=3, minutes=3, seed=5), "r")
    assert one != promtool_series(Scenario(ranks=3, minutes=3, seed=6), "r")


def test_every_case_checks_something_and_names_only_slow_ranks() -> None:
    for case in straggler_stat_cases.CASES:
        assert case.silent or case.named or case.run_silent or case.flagged, case.title
        for _, rank, _ in case.named:
            assert rank in case.scenario.slow, case.title
            assert case.scenario.slow[rank][0] >= 1.1, case.title


def test_the_committed_promtool_file_is_the_generated_one() -> None:
    committed = straggler_stat_cases.PATH.read_text()
    assert committed == straggler_stat_cases.render(), (
        "alert_rules/tests/stragglers_stat_test.yml is stale: run "
        "`python -m tests.straggler_stat_cases`")


def test_a_stall_is_one_long_step_that_every_rank_waits_for() -> None:
    table = scrapes(Scenario(ranks=2, minutes=2, jitter=0.0, stall=(1, 30.0, 20.0)))
    before, after = table[2], table[-1]  # 30 s, 120 s
    stalled = [a.compute - b.compute for a, b in zip(after, before, strict=True)]
    waited = [a.duration - b.duration for a, b in zip(after, before, strict=True)]
    steps = after[0].steps - before[0].steps
    assert stalled[1] - stalled[0] == pytest.approx(20.0)  # rank 1 computed 20 s longer
    assert waited[0] == waited[1] == pytest.approx(steps * 1.0 + 20.0)  # both stepped as slowly
