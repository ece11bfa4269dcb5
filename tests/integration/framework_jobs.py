"""Real 2-rank gloo jobs of `robust_metrics/workloads/framework_job.py` (Accelerate, the Hugging
Face Trainer, DeepSpeed) with one `watch()` line and a rank slowed 1.3x, and what a user relies on
from the series the hook wrote, held against the figures the framework itself computed (each
rank's record: the loss of each optimizer step and the gradient norm it clipped by).
Shared by test_frameworks_accelerate.py and test_frameworks_deepspeed.py."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from robust_metrics.workloads import framework_job
from tests.integration.parallel_jobs import assert_named, mean_compute, run_job, series, value

JOB = Path(framework_job.__file__).resolve()
STEPS = 16
WORLD = 2
# The slowdown (0.3 x the simulated compute of a step) must stand out from the jitter of the real
# work on a loaded 2-core machine, as in parallel_jobs.run_slow_rank_case.
COMPUTE = 0.4


@dataclass
class FrameworkRun:
    samples: dict[str, list[tuple[str, dict, float]]]
    records: list[dict[str, list[float]]]  # by rank: the framework's own losses and norms
    slow: int
    extra: float  # seconds per optimizer step the slow rank was slowed by


def run_framework(tmp_path: Path, framework: str, *args: str, slow: int = 1, grad_accum: int = 1,
                  env: dict[str, str] | None = None) -> FrameworkRun:
    """The job to its end with rank `slow` 1.3x slower in forward; its samples and records."""
    records = tmp_path / "records"
    records.mkdir()
    per_micro = COMPUTE / grad_accum
    samples = run_job(tmp_path, WORLD, "--framework", framework, "--grad-accum", str(grad_accum),
                      "--compute", str(per_micro), "--slow-rank", str(slow), "--slow-factor", "1.3",
                      "--record", str(records), *args, steps=STEPS, env=env, script=JOB)
    loaded = [json.loads((records / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return FrameworkRun(samples, loaded, slow, extra=0.3 * COMPUTE)


def assert_steps_counted_once(run: FrameworkRun) -> None:
    """One step per optimizer step (not per micro-batch, nor per parameter group), each timed."""
    for rank in range(WORLD):
        for name in ("robust_steps_total", "robust_global_step",
                     "robust_step_duration_seconds_count", "robust_step_compute_seconds_count"):
            assert value(run.samples, rank, name) == STEPS, (rank, name)
        assert series(run.samples, rank, "robust_hook_errors_total") == []


def assert_loss_and_grad_norm(run: FrameworkRun, loss_mean_over_ranks: bool = False) -> None:
    """The last step's loss is the one the rank computed (mean of its micro-batches), or, for the
    Trainer, whose log holds the mean over ranks, their mean; the gradient norm is the one the
    framework computed over the whole model and clipped by, the same on every rank."""
    losses = [value(run.samples, r, "robust_loss") for r in range(WORLD)]
    if loss_mean_over_ranks:
        assert math.isclose(sum(losses) / WORLD, run.records[0]["losses"][-1], abs_tol=1e-3), \
            (losses, run.records[0]["losses"][-1])
    else:
        for rank in range(WORLD):
            assert math.isclose(losses[rank], run.records[rank]["losses"][-1], rel_tol=1e-5), \
                (rank, losses[rank], run.records[rank]["losses"])
    for rank in range(WORLD):
        framework = run.records[rank]["grad_norms"]
        assert len(framework) == STEPS, framework
        published = value(run.samples, rank, "robust_grad_norm")
        assert math.isclose(published, framework[-1], rel_tol=1e-5), (rank, published, framework[-1])


def assert_collectives(run: FrameworkRun, ops: set[str]) -> None:
    """Every collective entered also completed, and each op the stack reduces or gathers
    gradients with was timed at least once per step on every rank."""
    for rank in range(WORLD):
        entered = {ls["group"]: v for ls, v in series(run.samples, rank,
                                                       "robust_collectives_entered_total")}
        completed = {ls["group"]: v for ls, v in series(run.samples, rank,
                                                         "robust_collectives_completed_total")}
        assert entered == completed, (entered, completed)
        counts: dict[str, float] = {}
        for labels, count in series(run.samples, rank, "robust_collective_duration_seconds_count"):
            counts[labels["op"]] = counts.get(labels["op"], 0.0) + count
        assert all(counts.get(op, 0) >= STEPS for op in ops), counts


def assert_slow_rank_named(run: FrameworkRun) -> tuple[float, float]:
    """The slowed rank is named by its compute, the other rank waited for it (blocked time); the
    compute ratio (slow over the other) and the other rank's blocked share of its step."""
    assert_named(run.samples, WORLD, run.slow, run.extra)
    other = 1 - run.slow
    blocked = (value(run.samples, other, "robust_step_duration_seconds_sum")
               - value(run.samples, other, "robust_step_compute_seconds_sum"))
    duration = value(run.samples, other, "robust_step_duration_seconds_sum")
    assert blocked >= STEPS * run.extra / 2, (blocked, duration)
    ratio = mean_compute(run.samples, run.slow) / mean_compute(run.samples, other)
    print(f"compute ratio slow/other {ratio:.3f}, the other rank blocked {blocked / duration:.0%}"
          f" of its step time; loss {[value(run.samples, r, 'robust_loss') for r in range(WORLD)]}"
          f", grad norm {value(run.samples, 0, 'robust_grad_norm'):.6f}"
          f" (framework {run.records[0]['grad_norms'][-1]:.6f})")
    return ratio, blocked / duration
