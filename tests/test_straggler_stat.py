"""The random series behind the statistical slow-rank cases, and the committed promtool file.

What the cases rely on: the series are what a hook would publish for the stated job (the compute
counters give back the jitter's spread and the slow rank's factor), a scenario is reproducible
from its seed, and alert_rules/tests/stragglers_stat_test.yml is what tests/straggler_stat_cases.py
generates (the promtool run in tests/test_rules.py judges it).
"""

from __future__ import annotations

import math

import pytest

from robust_metrics.workloads.straggler_series import Scenario, promtool_series, scrapes
from tests import straggler_stat_cases


def _minute(scenario: Scenario, rank: int, end_s: float) -> tuple[float, float]:
    """Mean and standard deviation of compute per step over the minute before `end_s`, from the
    counters as the rules read them: E[c^2] - E[c]^2."""
    table = scrapes(scenario)
    now, before = table[int(end_s // 15)][rank], table[int((end_s - 60) // 15)][rank]
    n = now.steps - before.steps
    mean = (now.compute - before.compute) / n
    variance = (now.compute_squared - before.compute_squared) / n - mean ** 2
    return mean, math.sqrt(variance)


def test_the_counters_give_back_the_jitter_and_the_slowdown() -> None:
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
