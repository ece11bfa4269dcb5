"""FSDP2 and pipelines on real GPUs with NCCL: a slowed rank is named from CUDA-event timing.

The same job as the gloo tests (tests/integration/parallel_jobs.py), with
`--device cuda`: one GPU per rank, NCCL, FSDP2's all-gathers and reduce-scatters on their own
streams, P2P works waited on the compute stream, compute as GPU kernels of a known length. What
tests/test_gpu_sim.py proves by simulation must hold here: rank 1, 1.3x slower in one phase, is
named by its compute (>= 1.2x the median of the others, no other above 1.1x), no hook error.
Needs 2 GPUs; skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.parallel_jobs import assert_named, run_job, series, value

pytestmark = pytest.mark.gpu
STEPS = 20
WORLD = 2


def two_gpus_with_nccl() -> str:
    """'' when 2 CUDA GPUs and NCCL are usable from torch, else why not."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "this torch build has no CUDA (install a CUDA build of torch on a GPU machine)"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    if torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} GPUs (one NCCL rank each), found {torch.cuda.device_count()}"
    return ""


CASES = {
    "fsdp2-forward": ["--stack", "fsdp2", "--slow-where", "forward"],
    "fsdp2-no-reshard-backward": ["--stack", "fsdp2", "--reshard-after-forward", "false",
                                  "--slow-where", "backward"],
    "pp-gpipe-forward": ["--stack", "pp", "--schedule", "gpipe", "--slow-where", "forward"],
    "pp-1f1b-backward": ["--stack", "pp", "--schedule", "1f1b", "--slow-where", "backward"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_slow_rank_is_named_on_gpus_with_nccl(tmp_path: Path, case: str) -> None:
    """Proves on real GPUs what the simulation cannot: torch issues and waits for these
    collectives where the model says, the hook's events land there, and it names the rank."""
    missing = two_gpus_with_nccl()
    if missing:
        pytest.skip(missing)
    samples = run_job(tmp_path, WORLD, "--device", "cuda", *CASES[case], "--slow-rank", "1",
                      "--slow-factor", "1.3", "--compute", "0.1", steps=STEPS,
                      env={"TORCH_NCCL_ENABLE_TIMING": "1"})
    for rank in range(WORLD):
        assert value(samples, rank, "robust_steps_total") == STEPS
        assert series(samples, rank, "robust_hook_errors_total") == []
        assert value(samples, rank, "robust_step_compute_seconds_count") >= STEPS - 2
    assert_named(samples, WORLD, 1, extra=0.3 * 0.1)
