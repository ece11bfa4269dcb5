"""What-if analysis: the published fixture ST, synthetic traces with known causes, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench.synthetic_trace import SyntheticJob, generate
from robust_metrics.analysis.whatif import (
    GraphError,
    JobMeta,
    MetaError,
    TraceError,
    analyze,
    build_model,
    load_model,
    read_trace,
)
from robust_metrics.analysis.whatif.loader import validate
from robust_metrics.analysis.whatif.naive import simulate_naive
from robust_metrics.analysis.whatif.simulate import simulate

ST = Path(__file__).parent / "fixtures" / "whatif-ST"


@pytest.fixture(scope="module")
def st_result():
    return analyze(load_model(ST / "trace-ST.parquet", ST / "meta-ST.yaml"))


def _model(job: SyntheticJob):
    meta = JobMeta(dp_size=job.dp, pp_size=job.pp, world_size=job.dp * job.pp)
    return build_model(validate(generate(job)), meta)


# -- fixture ST -----------------------------------------------------------------------------
def test_st_slowdown_matches_published(st_result):
    published = json.loads((ST / "result-ST.json").read_text())
    assert st_result.slowdown == pytest.approx(published["blocking_slowdown"], rel=0.01)
    assert st_result.t_original == pytest.approx(
        np.mean(list(published["step_t_nodelay"].values())), rel=0.01)
    for step, value in published["blocking_step_slowdown"].items():
        assert st_result.step_slowdown[int(step)] == pytest.approx(value, rel=0.01)


def test_st_stage_attribution_matches_published(st_result):
    published = json.loads((ST / "result-ST.json").read_text())["blocking_decompose_by_stage"]
    assert next(iter(st_result.by_stage)) == 3
    assert set(st_result.by_stage) == {int(k) for k in published}
    for stage, value in published.items():
        assert st_result.by_stage[int(stage)] == pytest.approx(value, rel=0.02)
    dp = json.loads((ST / "result-ST.json").read_text())["blocking_decompose_by_dp_rank"]
    for rank, value in dp.items():
        assert st_result.by_dp_rank[int(rank)] == pytest.approx(value, rel=0.02)


def test_st_ms_and_mw_match_published(st_result):
    ms = json.loads((ST / "ms-ST.json").read_text())["Ms"]
    mw = json.loads((ST / "mw-ST.json").read_text())["Mw"]
    assert abs(st_result.ms - ms) <= 0.03
    assert abs(st_result.mw - mw) <= 0.03


def test_st_replay_with_launch_delays_reproduces_trace():
    model = load_model(ST / "trace-ST.parquet", ST / "meta-ST.yaml")
    replay = simulate(model.graph, model.duration, model.transfer, model.delay)
    np.testing.assert_allclose(replay.start, model.start, atol=1e-9)
    np.testing.assert_allclose(replay.step_time, model.end.max(axis=(0, 1)), atol=1e-9)


# -- synthetic traces with known causes ----------------------------------------------------------
def test_one_slow_worker_pure_dp_has_the_expected_slowdown():
    job = SyntheticJob(dp=4, pp=1, microbatches=4, noise=0.0, worker_factor={(2, 0): 2.0})
    result = analyze(_model(job))
    # Every step is one chain whose DP collectives wait for the slow worker:
    compute = job.microbatches * (job.forward + job.backward)
    rest = 3 * job.dp_comm + job.gc + job.layernorm + job.embedding + job.clip + job.optimizer
    # the ideal compute is the mean over the 4 workers: (3 * 1 + 2) / 4 = 1.25
    expected = (2.0 * compute + rest) / (1.25 * compute + rest)
    assert result.slowdown == pytest.approx(expected, rel=0.01)
    assert next(iter(result.by_dp_rank)) == 2
    assert next(iter(result.rank_scores)) == 2
    assert result.mw > 0.9
    assert result.ms is None  # one stage: "the last stage" would be the whole job


def test_one_slow_worker_in_a_pipeline_is_ranked_first():
    job = SyntheticJob(dp=4, pp=4, microbatches=6, worker_factor={(1, 2): 2.0}, seed=3)
    result = analyze(_model(job))
    slow_rank = 2 * job.dp + 1
    assert result.slowdown > 1.2
    assert next(iter(result.by_dp_rank)) == 1
    assert next(iter(result.by_stage)) == 2
    assert next(iter(result.rank_scores)) == slow_rank
    assert result.mw_detail["ranks"] == [slow_rank]
    assert result.mw > 0.8
    assert result.ms < 0.3


def test_heavy_last_stage_gives_high_ms():
    job = SyntheticJob(dp=2, pp=4, microbatches=6, stage_factor={3: 1.6}, seed=1)
    result = analyze(_model(job))
    assert result.slowdown > 1.05
    assert next(iter(result.by_stage)) == 3
    assert result.ms > 0.8
    assert result.mw < 0.3


def test_no_straggler_has_no_attribution():
    result = analyze(_model(SyntheticJob(dp=4, pp=2, noise=0.01, seed=7)))
    assert result.slowdown == pytest.approx(1.0, abs=0.02)
    assert result.slowdown < 1.03
    assert result.by_dp_rank is None and result.by_stage is None and result.by_optype is None
    assert result.mw is None and result.ms is None


def test_vectorised_simulator_equals_naive():
    model = _model(SyntheticJob(dp=3, pp=3, microbatches=3, steps=3, noise=0.2,
                                worker_factor={(0, 1): 1.7}, seed=5))
    vectorised = simulate(model.graph, model.duration, model.transfer).step_time
    naive = simulate_naive(model.graph, model.duration, model.transfer)
    np.testing.assert_allclose(vectorised, naive, rtol=1e-12)


def test_jsonl_folder_gives_the_same_result_as_parquet(tmp_path):
    job = SyntheticJob(dp=2, pp=2, worker_factor={(1, 1): 1.5})
    df = generate(job)
    df.to_parquet(tmp_path / "trace.parquet")
    folder = tmp_path / "jsonl"
    folder.mkdir()
    for rank, part in df.groupby("rank"):
        part.to_json(folder / f"trace-rank{rank}.jsonl", orient="records", lines=True)
    a = analyze(load_model(tmp_path / "trace.parquet"))
    b = analyze(load_model(folder))
    # JSON keeps ~10 significant digits
    assert a.slowdown == pytest.approx(b.slowdown, rel=1e-6)
    assert a.by_stage == pytest.approx(b.by_stage, rel=1e-6)


# -- bad input -------------------------------------------------------------------------------
def test_missing_columns_are_named(tmp_path):
    df = generate(SyntheticJob(dp=2, pp=2)).drop(columns=["seq_id", "gmc"])
    df.to_parquet(tmp_path / "t.parquet")
    with pytest.raises(TraceError, match=r"missing column.*seq_id.*gmc"):
        read_trace(tmp_path / "t.parquet")


def test_unknown_optype_is_named():
    df = generate(SyntheticJob(dp=2, pp=2))
    df["optype"] = df.optype.astype(str)
    df.loc[0, "optype"] = "warp-drive"
    with pytest.raises(TraceError, match="warp-drive"):
        validate(df)


def test_op_missing_on_one_rank_is_named():
    df = generate(SyntheticJob(dp=2, pp=2))
    drop = df[(df.dp_rank == 1) & (df.step == 2) & (df.optype == "backward-compute")
              & (df.stage == 1) & (df.seq_id == 1)].index
    with pytest.raises(GraphError, match=r"backward-compute_1_1 is missing on dp_rank 1 in step 2"):
        build_model(validate(df.drop(index=drop)), JobMeta(dp_size=2, pp_size=2, world_size=4))


def test_unpaired_p2p_is_named():
    df = generate(SyntheticJob(dp=2, pp=3))
    drop = df[(df.optype == "forward-recv") & (df.stage == 1) & (df.seq_id == 2)].index
    with pytest.raises(GraphError, match=r"forward-(send|recv)"):
        build_model(validate(df.drop(index=drop)), JobMeta(dp_size=2, pp_size=3, world_size=6))


def test_metadata_that_does_not_match_the_trace(tmp_path):
    meta = tmp_path / "meta.yaml"
    meta.write_text("dp_size: 4\npp_size: 4\nworld_size: 16\n")
    with pytest.raises(MetaError, match="dp_size=4 but the trace has 2 DP ranks"):
        load_model(ST / "trace-ST.parquet", meta)
    meta.write_text("dp_size: 2\npp_size: 4\nworld_size: 9\n")
    with pytest.raises(MetaError, match="world_size=9"):
        load_model(ST / "trace-ST.parquet", meta)


def test_incomplete_last_step_is_dropped():
    df = generate(SyntheticJob(dp=2, pp=2, steps=4))
    df = df[~((df.step == 3) & (df.dp_rank == 1))]
    model = build_model(validate(df), JobMeta(dp_size=2, pp_size=2, world_size=4))
    assert model.dropped_steps == [3]
    assert list(model.steps) == [0, 1, 2]


def test_attribution_threshold_is_respected():
    model = _model(SyntheticJob(dp=2, pp=2, worker_factor={(0, 0): 1.3}))
    s = analyze(model).slowdown
    assert analyze(model, threshold=s + 0.01).by_stage is None
    assert analyze(model, threshold=s - 0.01).by_stage is not None
    assert math.isfinite(s)


def test_frame_from_pandas_categories_is_accepted():
    df = pd.read_parquet(ST / "trace-ST.parquet")
    assert isinstance(df.optype.dtype, pd.CategoricalDtype)
    assert len(validate(df)) == len(df)


# -- coverage: how much of the step the traced ops explain ----------------------------------------
UNTRACED = Path(__file__).parent / "fixtures" / "whatif-untraced"


def test_st_is_covered_enough_to_attribute(st_result):
    assert st_result.coverage == pytest.approx(st_result.t_original / st_result.t_trace)
    assert st_result.coverage == pytest.approx(0.981, abs=0.001)
    assert st_result.covered and st_result.attributed and st_result.warnings == []


def test_a_straggler_between_the_traced_ops_blames_nobody():
    # a real 2-rank DDP trace; rank 1 sleeps 50 ms per step outside every traced op
    model = load_model(UNTRACED, steps=range(2, 100))
    result = analyze(model)
    assert result.slowdown >= 1.03  # above the attribution threshold: coverage alone stops it
    assert result.coverage < 0.2 and not result.covered
    assert not result.attributed and result.rank_scores is None and result.mw is None
    (warning,) = result.warnings
    assert f"explain only {result.coverage:.0%}" in warning and "no rank or stage" in warning
    doc = result.to_json()
    assert doc["coverage"] == result.coverage and doc["min_coverage"] == 0.8
    assert doc["warnings"] == [warning] and doc["by_dp_rank"] is None
    from robust_metrics.analysis.whatif.report import diagnosis, summary, verdict

    assert verdict(result) == "none"
    assert diagnosis(result).startswith("nothing can be attributed")
    text = summary(result)
    assert "WARNING: the traced ops explain only" in text and "top ranks" not in text
    assert "spread-out" not in text
    # what the gate holds back: an attribution of traced noise ("spread-out cause")
    forced = analyze(model, min_coverage=0.0)
    assert forced.attributed and forced.warnings == []
    assert verdict(forced) == "spread"


def test_synthetic_traces_are_fully_covered():
    result = analyze(_model(SyntheticJob(dp=2, pp=2, worker_factor={(1, 1): 2.0})))
    assert 0.99 <= result.coverage <= 1.0 + 1e-9 and result.attributed
