"""Megatron-core's way of reducing gradients, with the one-line hook, on real 2-rank gloo jobs.

megatron-core 0.16.1 cannot run on the CPU (docs/hook.md, Parallelisms), so these jobs run
tests/megatron_like.py, which imitates its DistributedDataParallel (a contiguous gradient
buffer, bucket groups reduced async from gradient-accumulator hooks inside
`_coalescing_manager`, `finish_grad_sync` waiting on their handles) and its distributed
optimizer (a reduce-scatter into each rank's shard, the parameters all-gathered after the step,
or overlapped with the next forward). Each job has rank 1 slowed 1.3x in its forward and writes
what it measured itself: its step times and the seconds inside its handles' waits.

What a user relies on: one step per optimizer step; the step time and the blocked time are the
job's own (the blocked time is the waits on those handles, so compute is the rest); the slowed
rank named by its compute, its peer blocked for it; each coalesced block counted once entered and
once completed in its group; no hook error. The GPU timing of the same job is simulated in
tests/test_hook_megatron.py; the real megatron-core runs only where a GPU is
(`test_the_real_megatron_core_on_gpus`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests import megatron_like
from tests.integration.parallel_jobs import assert_named, run_job, series, value

JOB = Path(megatron_like.__file__).resolve()
STEPS, WORLD, SLOW = 12, 2, 1
COMPUTE = 0.1  # forward seconds; the slowed rank's is 1.3x
EXTRA = 0.3 * COMPUTE

# id: (job arguments, {op: collectives per bucket group per step})
CASES = {
    "all-reduce": (["--optimizer", "plain"], {"all_reduce": 1}),
    "distributed-optimizer": (["--optimizer", "distributed"],
                              {"reduce_scatter": 1, "all_gather": 1}),
    "distributed-optimizer-overlap-param-gather": (
        ["--optimizer", "distributed", "--overlap-param-gather"],
        {"reduce_scatter": 1, "all_gather": 1}),
}


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
        ) -> tuple[dict, list[dict]]:
    records = tmp_path / "records"
    records.mkdir()
    samples = run_job(tmp_path, WORLD, *args, "--compute", str(COMPUTE), "--slow-rank", str(SLOW),
                      "--slow-factor", "1.3", "--record", str(records), steps=STEPS, script=JOB,
                      env=env)
    return samples, [json.loads((records / f"rank{r}.json").read_text()) for r in range(WORLD)]


def assert_counted(samples: dict, ops: dict[str, int], groups: int) -> None:
    """One step per optimizer step, no hook error, and each coalesced block (one per bucket
    group and collective) entered and completed once, in the data-parallel group."""
    for rank in range(WORLD):
        for name in ("robust_steps_total", "robust_step_duration_seconds_count",
                     "robust_step_compute_seconds_count"):
            assert value(samples, rank, name) == STEPS, (rank, name)
        assert series(samples, rank, "robust_hook_errors_total") == []
        blocks = STEPS * groups * sum(ops.values())
        entered = {ls["group"]: v for ls, v in series(samples, rank,
                                                       "robust_collectives_entered_total")}
        completed = {ls["group"]: v for ls, v in series(samples, rank,
                                                         "robust_collectives_completed_total")}
        assert entered == completed == {"default_pg": blocks}, (rank, entered, completed)
        counts = {ls["op"]: v for ls, v in series(samples, rank,
                                                   "robust_collective_duration_seconds_count")}
        assert counts == {op: STEPS * groups * n for op, n in ops.items()}, (rank, counts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_like_data_parallel(tmp_path: Path, case: str) -> None:
    args, ops = CASES[case]
    samples, own = run(tmp_path, *args)
    assert_counted(samples, ops, own[0]["bucket_groups"])
    for rank in range(WORLD):
        duration = value(samples, rank, "robust_step_duration_seconds_sum")
        blocked = duration - value(samples, rank, "robust_step_compute_seconds_sum")
        own_duration = own[rank]["step_ends"][-1] - own[rank]["start"]
        waits = sum(own[rank]["waits"])
        report = f"rank {rank}: step {duration:.4f} s (job {own_duration:.4f}), " \
                 f"blocked {blocked:.4f} s (job's waits {waits:.4f})"
        print(report)
        # the hook's steps end where the job's do; its blocked time is the job's waits (the
        # hook's own marks lie inside them, a few microseconds apart per wait)
        assert duration == pytest.approx(own_duration, rel=0.03, abs=0.02), report
        assert blocked == pytest.approx(waits, rel=0.05, abs=0.005), report
    assert_named(samples, WORLD, SLOW, EXTRA)
    other = 1 - SLOW
    blocked_other = (value(samples, other, "robust_step_duration_seconds_sum")
                     - value(samples, other, "robust_step_compute_seconds_sum"))
    assert blocked_other >= STEPS * EXTRA / 2, blocked_other  # it waited for the slowed rank


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (pip install megatron-core): the real "
                           "DistributedDataParallel needs it and CUDA")
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_real_megatron_core_on_gpus(tmp_path: Path, case: str) -> None:
    """The same job with megatron-core's own DistributedDataParallel and optimizer on NCCL, one
    GPU per rank: what the simulation assumes of it (coalesced blocks counted once, no hook
    error, the slowed rank named) holds on the real thing."""
    import torch

    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, {torch.cuda.device_count()} found")
    args, ops = CASES[case]
    samples, own = run(tmp_path, *args, "--megatron")
    for rank in range(WORLD):
        assert value(samples, rank, "robust_steps_total") == STEPS
        assert len(own[rank]["step_ends"]) == STEPS
        assert series(samples, rank, "robust_hook_errors_total") == []
        entered = {ls["group"]: v for ls, v in series(samples, rank,
                                                       "robust_collectives_entered_total") if v}
        completed = {ls["group"]: v for ls, v in series(samples, rank,
                                                         "robust_collectives_completed_total")
                     if v}
        assert entered == completed and entered, (entered, completed)
        counts = {ls["op"]: v for ls, v in series(samples, rank,
                                                   "robust_collective_duration_seconds_count")}
        assert all(counts.get(op, 0) >= STEPS for op in ops), counts
    assert_named(samples, WORLD, SLOW, EXTRA)
