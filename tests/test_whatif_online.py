"""The study's own trace online: the published what-if trace ST as the series its ranks' hooks
would have published, through the shipped rules in promtool, against `robust-metrics whatif`.

What the case relies on: the series are the trace as the hook times a step (step = compute +
blocked on every rank, blocked = the union of the rank's communication ops), the trace is played
end to end at its own step times, and alert_rules/tests/whatif_st_test.yml is what
tests/whatif_online_cases.py generates. promtool then judges it: online S within 10% of the
what-if's, the same verdict and worst stage (figures in docs/whatif.md).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from robust_metrics import schema
from robust_metrics.analysis.whatif import load_model
from robust_metrics.analysis.whatif.report import verdict
from robust_metrics.workloads import trace_series
from tests import whatif_online_cases as cases
from tests.support import require_binary


@pytest.fixture(scope="module")
def model():
    return load_model(cases.ST / "trace-ST.parquet", cases.ST / "meta-ST.yaml")


def test_overlapping_waits_count_once() -> None:
    assert trace_series._union([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (1.5, 1.8)]) == 3.0
    assert trace_series._union([]) == 0.0


def test_a_step_is_compute_plus_blocked_on_every_rank(model) -> None:
    timed = trace_series.rank_steps(model)
    assert timed.ranks == list(range(8))
    np.testing.assert_allclose(timed.compute + timed.blocked, np.broadcast_to(
        timed.duration, timed.compute.shape))
    assert (timed.blocked >= 0).all() and (timed.compute > 0).all()
    # the trace's own mean step time (what `robust-metrics whatif` reports as t_trace)
    assert timed.duration.mean() == pytest.approx(cases.whatif().t_trace, rel=1e-6)
    # the heavy last stage (ranks 6 and 7) computes ~1.6x the others and waits least
    per_rank = timed.compute.mean(axis=1)
    assert per_rank[6:].min() > 1.5 * per_rank[:6].max()
    assert timed.blocked.mean(axis=1)[6:].max() < timed.blocked.mean(axis=1)[:6].min()
    assert trace_series.topology(model)[7] == {"dp_rank": "1", "pp_rank": "3", "tp_rank": "0"}


def test_the_trace_is_played_end_to_end_at_its_step_times(model) -> None:
    """A scrape at t counts the steps that ended by t, the 32 sampled steps over and over."""
    timed = trace_series.rank_steps(model)
    table = trace_series.scrapes(model, 5)
    assert [row[0].t for row in table] == [15.0 * i for i in range(21)]
    ends = np.cumsum(np.tile(timed.duration, 5))  # 5 passes of ~71 s: past 5 minutes
    compute = np.tile(timed.compute, 5)
    for row in table:
        done = int((ends <= row[0].t).sum())
        assert done < len(ends)
        for r, scrape in enumerate(row):
            assert scrape.steps == done
            assert scrape.compute == pytest.approx(compute[r, :done].sum())
            if done:  # the hook's windows over the steps played by then (none before the first)
                inside = slice(int((ends[:done] <= ends[done - 1] - 60).sum()), done)
                mean = compute[r, inside].mean()
                assert scrape.windows[schema.STEP_COMPUTE_MEAN.name, "1m"] == pytest.approx(mean)
                assert scrape.windows[schema.STEP_COMPUTE_VARIATION.name, "1m"] == pytest.approx(
                    compute[r, inside].std() / mean)
                assert scrape.windows[schema.WINDOW_STEPS.name, "1m"] == done - inside.start
            else:
                assert scrape.windows == {}
            assert scrape.duration == pytest.approx(ends[done - 1] if done else 0.0)
            assert scrape.last_step == scrape.duration


def test_the_committed_promtool_file_is_the_generated_one() -> None:
    assert cases.PATH.read_text() == cases.render(), (
        "alert_rules/tests/whatif_st_test.yml is stale: run `python -m tests.whatif_online_cases`")


def test_online_s_and_verdict_agree_with_the_whatif() -> None:
    result = cases.whatif()
    assert result.slowdown > 1.1 and verdict(result) == "stage"  # a case worth asking about
    promtool = require_binary("promtool")
    run = subprocess.run([promtool, "test", "rules", cases.PATH.name], cwd=cases.PATH.parent,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
