"""The hook's what-if trace recorder: a real 4-rank gloo job with one slow rank, analysed."""

from __future__ import annotations

import json
from pathlib import Path

from robust_metrics import optrace
from robust_metrics.analysis.whatif import analyze, load_model
from tests.support import RankJob

JOB = Path(__file__).parent.parent / "whatif_trace_job.py"


def test_trace_of_a_real_job_names_the_slow_rank(tmp_path):
    trace = tmp_path / "trace"
    env = {"TRACE_DIR": str(trace), "TRACE_EVERY": "2", "TRACE_STEPS": "1",
           "ROBUST_METRICS_BACKEND": "null"}
    args = ["--steps", "16", "--slow-rank", "2", "--slow-seconds", "0.05"]
    with RankJob(4, args, script=JOB, env=env, log_dir=tmp_path) as job:
        codes = job.wait(timeout=180)
        assert codes == [0, 0, 0, 0], job.logs()
    files = sorted(p.name for p in trace.glob("*.jsonl"))
    assert files == [f"trace-rank{r}.jsonl" for r in range(4)]
    rows = [json.loads(line) for line in (trace / "trace-rank0.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == set(range(0, 16, 2))  # every 2nd step, 1 step each
    assert all(set(r) == set(optrace.COLUMNS) for r in rows)  # the format's columns, no more
    assert {r["optype"] for r in rows} >= {"forward-compute", "backward-compute",
                                           "grads-reduce-scatter", "optimizer", "gc"}

    # step 0 is warm-up (lazy initialisation on every rank), so it is left out
    result = analyze(load_model(trace, steps=range(2, 16)))
    assert len(result.step_slowdown) == 7
    assert result.slowdown > 1.5  # 50 ms of sleep against a few-ms step
    assert next(iter(result.by_dp_rank)) == 2
    assert next(iter(result.rank_scores)) == 2
    assert result.mw_detail["ranks"] == [2]
    assert result.mw > 0.5  # fixing rank 2 removes most of the slowdown
    assert next(iter(result.by_optype)) == "forward-compute"
    from robust_metrics.analysis.whatif.report import diagnosis

    assert "bad worker" in diagnosis(result) and "rank(s) 2" in diagnosis(result)
    assert result.covered and result.warnings == []  # the sleep is inside the traced forward


def test_a_rank_slow_between_traced_ops_is_not_misattributed(tmp_path):
    # 2 DDP ranks; rank 1 spends 50 ms per step in host work no traced op covers
    trace = tmp_path / "trace"
    env = {"TRACE_DIR": str(trace), "TRACE_EVERY": "2", "TRACE_STEPS": "1",
           "ROBUST_METRICS_BACKEND": "null", "UNTRACED_SLOW_RANK": "1",
           "UNTRACED_SECONDS": "0.05"}
    with RankJob(2, ["--steps", "16"], script=JOB, env=env, log_dir=tmp_path) as job:
        codes = job.wait(timeout=180)
        assert codes == [0, 0], job.logs()
    result = analyze(load_model(trace, steps=range(2, 16)))
    assert result.t_trace > 0.04  # the traced step holds rank 1's 50 ms, between its ops
    assert result.coverage < 0.5 and not result.attributed
    assert result.rank_scores is None and len(result.warnings) == 1
