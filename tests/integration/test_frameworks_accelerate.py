"""Hugging Face Accelerate and the Trainer with the one-line hook: `accelerator.prepare()` under
its DDP and FSDP (FSDP2) plugins with `accelerator.backward` and gradient accumulation, and
`Trainer` with `RobustMetricsCallback` under DDP and FSDP2, each a real 2-rank gloo job with a
rank slowed 1.3x (tests/integration/framework_jobs.py).

Accelerate picks its FSDP plugin only on accelerators; on the CPU the job sets the state that
`prepare()` reads as it is on a GPU (framework_job.force_fsdp), so Accelerate's own FSDP path runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.framework_jobs import (
    assert_collectives,
    assert_loss_and_grad_norm,
    assert_slow_rank_named,
    assert_steps_counted_once,
    run_framework,
)
from tests.integration.parallel_jobs import run_job, series, value

pytest.importorskip("accelerate", reason="the huggingface extra is not installed")


def test_accelerate_ddp_with_gradient_accumulation(tmp_path: Path) -> None:
    """Two micro-batches per step: one step counted per optimizer step, and the loss the user
    computed, not the one `accelerator.backward` divided by the accumulation steps."""
    run = run_framework(tmp_path, "accelerate-ddp", grad_accum=2, slow=1)
    assert_steps_counted_once(run)
    assert_loss_and_grad_norm(run)
    assert_collectives(run, {"all_reduce"})
    assert_slow_rank_named(run)


def test_accelerate_fsdp2(tmp_path: Path) -> None:
    """The gradient norm is the whole model's that `accelerator.clip_grad_norm_` computed and
    clipped by, not the rank's shard; all-gathers and reduce-scatters are blocked time."""
    run = run_framework(tmp_path, "accelerate-fsdp", slow=0)
    assert_steps_counted_once(run)
    assert_loss_and_grad_norm(run)
    assert_collectives(run, {"all_gather", "reduce_scatter"})
    assert_slow_rank_named(run)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "ddp"])
def test_trainer_callback(tmp_path: Path, fsdp: bool) -> None:
    """The Trainer hands its callbacks the inner module: under DDP the callback watches the
    wrapper, whose gradient all-reduce is the wait that names the slow rank."""
    pytest.importorskip("transformers", reason="the huggingface extra is not installed")
    run = run_framework(tmp_path, "hf-trainer", *(["--trainer-fsdp"] if fsdp else []), slow=1)
    assert_steps_counted_once(run)
    assert_loss_and_grad_norm(run, loss_mean_over_ranks=True)
    assert_collectives(run, {"all_gather", "reduce_scatter"} if fsdp else {"all_reduce"})
    assert_slow_rank_named(run)


def test_the_example_trains_with_the_one_line(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "train_accelerate.py"
    samples = run_job(tmp_path, 2, steps=4, script=script)
    for rank in range(2):
        assert value(samples, rank, "robust_steps_total") == 4
        assert series(samples, rank, "robust_hook_errors_total") == []
        ops = {ls["op"] for ls, v in series(samples, rank,
                                           "robust_collective_duration_seconds_count") if v}
        assert {"all_reduce"} <= ops, ops
