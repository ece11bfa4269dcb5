"""Megatron-core's data parallelism under the hook, where megatron-core itself cannot run.

Megatron-core 0.16.1 issues every gradient reduction and parameter all-gather inside
`torch.distributed._coalescing_manager`, where a call only records its op and the block's end
issues one collective (hooks/collectives/coalesced.py). In one process, on gloo, the job's
imitation (tests/megatron_like.py) shows the hook counts each block once; its GPU timing (CUDA
events read a step late, the compute stream waiting in `cm.wait()`) is simulated by
tests/gpu_sim.py's `megatron` mode through the hook's own wrappers. Two-rank gloo jobs of the same
imitation are tests/integration/test_megatron_gloo.py.

What no simulation shows, only a GPU with megatron-core can (the `gpu`-marked test there): that
megatron-core and NCCL issue and wait as imitated here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import robust_metrics
from tests.gpu_sim import Profile, SimJob, online_estimate, simulate
from tests.hook_models import value
from tests.megatron_like import (
    DistributedOptimizerLike,
    MegatronLikeDDP,
    Paced,
    PlainOptimizerLike,
    WaitClock,
    train_step,
)

STEPS = 4


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo group for one test (the simulated ranks run outside any group)."""
    store = tmp_path / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def megatron_job(distributed: bool, overlap: bool = False,
                 ) -> tuple[MegatronLikeDDP, DistributedOptimizerLike | PlainOptimizerLike]:
    torch.manual_seed(0)
    model = MegatronLikeDDP(Paced(16, 0.0), distributed=distributed, overlap_param_gather=overlap,
                            bucket_numel=2 * 16 * 17, clock=WaitClock())
    return model, DistributedOptimizerLike(model) if distributed else PlainOptimizerLike(model)


@pytest.mark.parametrize(("distributed", "overlap", "ops"), [
    (False, False, {"all_reduce"}),
    (True, False, {"reduce_scatter", "all_gather"}),
    (True, True, {"reduce_scatter", "all_gather"}),
], ids=["all-reduce", "distributed-optimizer", "overlap-param-gather"])
def test_each_coalesced_block_is_one_collective_entered_and_completed(
        gloo: None, distributed: bool, overlap: bool, ops: set[str]) -> None:
    """Each bucket group's block is counted once entered and once completed per step (not once
    per call inside it, whose placeholder work is never waited for), with no hook error."""
    model, optimizer = megatron_job(distributed, overlap)
    groups = len(model.bucket_groups)
    assert groups == 2
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        for _ in range(STEPS):
            train_step(model, optimizer, torch.randn(4, 16))
        _, entered, completed = handle.tracker.snapshot()
        assert entered == completed == {"default_pg": STEPS * groups * len(ops)}
        for op in ops:
            assert value(handle, "robust_collective_duration_seconds_count", op=op,
                         group="default_pg") == STEPS * groups
        assert value(handle, "robust_steps_total") == STEPS
        assert [s for s in handle.store.samples() if s.name == "robust_hook_errors_total"
                and s.value] == []


# -- the GPU timing, simulated -----------------------------------------------------------------
RANKS, SLOW = 8, 5
BASE = Profile(forward=0.030, backward=0.060, optimizer=0.010)
MODES = {
    "all-reduce": {},
    "distributed-optimizer": {"dist_opt": True},
    "overlap-param-gather": {"dist_opt": True, "overlap_param_gather": True},
}


def job(name: str, phase: str | None, **kw: object) -> SimJob:
    ranks = [BASE] * RANKS
    if phase is not None:
        ranks[SLOW] = BASE.scaled(phase, 1.3)
    return SimJob(tuple(ranks), mode="megatron", buckets=2, **{**MODES[name], **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_a_slow_rank_is_named_by_its_compute_on_gpus(name: str, phase: str) -> None:
    """A rank 1.3x slower in one phase: its compute ratio to the median of the others is 1.3
    (SlowRank needs 1.25), no other rank moves; its peers' extra time is blocked."""
    estimate = online_estimate(simulate(job(name, phase)))
    ratios = estimate["vs_others"]
    assert estimate["named"] == SLOW
    assert ratios[SLOW] == pytest.approx(1.3, abs=0.02), ratios
    assert all(abs(r - 1.0) < 0.02 for i, r in enumerate(ratios) if i != SLOW), ratios


@pytest.mark.parametrize("name", list(MODES))
def test_a_healthy_megatron_job_has_no_straggler_on_gpus(name: str) -> None:
    ratios = online_estimate(simulate(job(name, None)))["vs_others"]
    assert max(ratios) < 1.02, ratios


@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("phase", ["forward", None])
def test_blocked_is_the_compute_streams_waits_on_the_handles_step_by_step(
        name: str, phase: str | None) -> None:
    """Each step's blocked time is exactly the time the simulated compute stream stalled in
    `cm.wait()` (the gradient reductions in `finish_grad_sync`, the all-gathers after the step or
    in the next forward's pre-hooks), so step minus blocked is the rank's compute, on every rank
    and step: reductions overlapped with backward are not counted, nothing waited for is missed."""
    result = simulate(job(name, phase))
    for view in result.views:
        # the last step is not read yet; the first is timed by the host (no start mark)
        rows = list(zip(view.measured, view.true_compute[:-1], view.true_blocked[:-1],
                        strict=True))[1:]
        assert len(rows) > 30
        assert any(stalled > 0 for _, _, stalled in rows)
        for (seconds, blocked), compute, stalled in rows:
            assert blocked == pytest.approx(stalled, abs=1e-9)
            assert seconds - blocked == pytest.approx(compute, abs=1e-9)


@pytest.mark.parametrize("name", list(MODES))
def test_steps_are_read_one_step_late_and_blocks_counted_once_on_gpus(name: str) -> None:
    """With the host a step ahead, each step end reads the step before without a read the
    device has not reached; each bucket group's coalesced block (2 buckets) counts once entered
    and completed per collective, the calls inside it not at all."""
    steps, layers = 12, 4
    result = simulate(job(name, "backward", steps=steps, lead=1, layers=layers))
    collectives = 2 if MODES[name] else 1  # the distributed optimizer all-gathers too
    for view in result.views:
        assert view.source.early_reads == 0
        assert view.reads == [0] + [1] * (steps - 1)
        assert view.timer.dropped == 0
        _, entered, completed = view.tracker.snapshot()
        assert entered == completed == {"dp": steps * layers * collectives}
