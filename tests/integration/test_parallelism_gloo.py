"""The hook on the stacks large models are trained with, as real gloo jobs on the CPU: the
topology labels from the DeviceMesh or the pipeline stage, the GradScaler's skipped steps, a
torch.compile'd model, and the examples. A slowed rank on each stack is named in
test_slow_rank_fsdp2_tp_gloo.py and test_slow_rank_pipeline_gloo.py; the jobs and their reading
are in parallel_jobs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.parallel_jobs import (
    STEPS,
    assert_clean,
    assert_named,
    info,
    run_job,
    series,
    value,
)


def test_topology_comes_from_the_device_mesh_and_the_pipeline_stage(tmp_path: Path) -> None:
    samples = run_job(tmp_path, 4, "--stack", "fsdp2_tp", "--compute", "0.02")
    assert [info(samples, r) for r in range(4)] == [
        {"dp_rank": "0", "pp_rank": "", "tp_rank": "0"}, {"dp_rank": "0", "pp_rank": "", "tp_rank": "1"},
        {"dp_rank": "1", "pp_rank": "", "tp_rank": "0"}, {"dp_rank": "1", "pp_rank": "", "tp_rank": "1"}]


def test_pipeline_ranks_get_their_stage_and_dp_coordinates(tmp_path: Path) -> None:
    samples = run_job(tmp_path, 4, "--stack", "pp_fsdp2", "--compute", "0.02")
    assert [info(samples, r) for r in range(4)] == [
        {"dp_rank": "0", "pp_rank": "0", "tp_rank": ""}, {"dp_rank": "1", "pp_rank": "0", "tp_rank": ""},
        {"dp_rank": "0", "pp_rank": "1", "tp_rank": ""}, {"dp_rank": "1", "pp_rank": "1", "tp_rank": ""}]


def test_steps_the_grad_scaler_skips_are_steps_of_the_loop(tmp_path: Path) -> None:
    """fp16-style loss scaling with an overflow every 4th step: every iteration is a step, the
    skipped ones are counted, their inf gradients are no non-finite gradients, and the loss
    published is the unscaled one."""
    samples = run_job(tmp_path, 2, "--stack", "ddp", "--amp-skip-every", "4", "--compute", "0.01")
    for rank in range(2):
        assert value(samples, rank, "robust_steps_total") == STEPS
        assert value(samples, rank, "robust_step_duration_seconds_count") == STEPS
        assert value(samples, rank, "robust_skipped_steps_total") == STEPS // 4
        assert value(samples, rank, "robust_nonfinite_grad_steps_total") == 0
        assert value(samples, rank, "robust_nonfinite_loss_steps_total") == 0
        assert 0 < value(samples, rank, "robust_loss") < 10  # scaled by 256 it would be larger
        assert series(samples, rank, "robust_hook_errors_total") == []


def test_a_job_without_a_grad_scaler_spends_no_series_on_skipped_steps(tmp_path: Path) -> None:
    samples = run_job(tmp_path, 2, "--stack", "fsdp2", "--compute", "0.01")
    assert series(samples, 0, "robust_skipped_steps_total") == []


def test_a_compiled_ddp_model_is_timed_and_names_its_slow_rank(tmp_path: Path) -> None:
    """DDP around a torch.compile'd model (its simulated compute is compiled with it: the rank
    is slowed in the optimizer, outside the graph)."""
    samples = run_job(tmp_path, 2, "--stack", "ddp", "--compile", "--slow-rank", "1",
                      "--slow-where", "optimizer", "--slow-factor", "1.3", "--compute", "0.25")
    assert_clean(samples, 2, {"default_pg"})
    assert_named(samples, 2, 1, extra=0.3 * 0.25)


@pytest.mark.parametrize("example", ["train_fsdp2.py", "train_pipeline.py"])
def test_the_examples_train_with_the_one_line(tmp_path: Path, example: str) -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / example
    samples = run_job(tmp_path, 2, steps=6, script=script)
    assert value(samples, 0, "robust_steps_total") == value(samples, 1, "robust_steps_total") == 6
    assert not [(name, labels) for rank in samples for name, labels, v in samples[rank]
                if name == "robust_hook_errors_total" and v > 0]
