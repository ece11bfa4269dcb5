"""The hook on the stacks large models are trained with, as real gloo jobs on the CPU.

Each case is a real job of `robust_metrics/workloads/parallel_job.py` (FSDP2, tensor parallelism
with and without sequence parallelism, pipeline schedules, 2-D meshes, torch.compile) with one
`watch()` line and one rank slowed 1.3x in forward, backward or the optimizer. What `watch()` wrote
is read back with prometheus_client's own MultiProcessCollector. The slowed rank must be named by
its compute time (the compute/blocked split), with no hook error, every collective entered also
completed, and the topology labels taken from the DeviceMesh or the pipeline stage.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from robust_metrics import workloads
from robust_metrics.processes import RankJob

pytestmark = pytest.mark.integration
JOB = Path(workloads.__file__).resolve().parent / "parallel_job.py"
STEPS = 16


def run_job(tmp_path: Path, world: int, *args: str, steps: int = STEPS,
            env: dict[str, str] | None = None) -> dict[str, list[tuple[str, dict, float]]]:
    """Run the job; its samples by rank: (name, labels without run and rank, value)."""
    folder, logs = tmp_path / "metrics", tmp_path / "logs"
    folder.mkdir()
    logs.mkdir()
    with RankJob(world, ["--steps", str(steps), *args], script=JOB, log_dir=logs,
                 env={"ROBUST_METRICS_DIR": str(folder), **(env or {})}, run="parallel") as job:
        codes = job.wait(timeout=240)
        assert codes == [0] * world, job.logs()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    samples: dict[str, list[tuple[str, dict, float]]] = {}
    for family in registry.collect():
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("run", "rank")}
            samples.setdefault(s.labels.get("rank", ""), []).append((s.name, labels, s.value))
    return samples


def value(samples: dict, rank: int, name: str, **labels: str) -> float:
    found = [v for n, ls, v in samples[str(rank)] if n == name and ls == labels]
    assert found, f"rank {rank} has no {name}{labels}"
    return found[0]


def series(samples: dict, rank: int, name: str) -> list[tuple[dict, float]]:
    return [(ls, v) for n, ls, v in samples[str(rank)] if n == name]


def mean_compute(samples: dict, rank: int) -> float:
    return (value(samples, rank, "robust_step_compute_seconds_sum")
            / value(samples, rank, "robust_step_compute_seconds_count"))


def assert_named(samples: dict, world: int, slow: int) -> None:
    """Compute ratios against the median of the other ranks: the slowed one >= 1.2, no other
    above 1.1 (with 2 ranks the median of both would halve any difference)."""
    computes = [mean_compute(samples, r) for r in range(world)]
    median = statistics.median(c for r, c in enumerate(computes) if r != slow)
    ratios = [c / median for c in computes]
    assert ratios[slow] >= 1.2, ratios
    assert all(r <= 1.1 for i, r in enumerate(ratios) if i != slow), ratios


def assert_clean(samples: dict, world: int, groups: set[str]) -> None:
    """Every step counted, no hook error, every collective entered completed, in named groups;
    sends and receives counted per pair of ranks (`group:0-1`), equal on both ends."""
    pairs: dict[str, set[float]] = {}
    for rank in range(world):
        assert value(samples, rank, "robust_steps_total") == STEPS
        assert value(samples, rank, "robust_global_step") == STEPS
        assert series(samples, rank, "robust_hook_errors_total") == []
        entered = {ls["group"]: v for ls, v in series(samples, rank,
                                                       "robust_collectives_entered_total") if v}
        completed = {ls["group"]: v for ls, v in series(samples, rank,
                                                         "robust_collectives_completed_total") if v}
        assert entered == completed, (entered, completed)
        assert {g.split(":")[0] for g in entered} == groups, entered
        for group, count in entered.items():
            if ":" in group:
                pairs.setdefault(group, set()).add(count)
    assert all(len(counts) == 1 for counts in pairs.values()), pairs


def info(samples: dict, rank: int) -> dict[str, str]:
    (labels, _), = series(samples, rank, "robust_rank_info")
    return {k: labels[k] for k in ("dp_rank", "pp_rank", "tp_rank")}


CASES = {
    # id: (world, slow rank, groups with collectives, job arguments)
    "fsdp2-forward": (2, 1, {"default_pg"}, ["--stack", "fsdp2", "--slow-where", "forward"]),
    "fsdp2-no-reshard-backward": (2, 0, {"default_pg"}, [
        "--stack", "fsdp2", "--reshard-after-forward", "false", "--slow-where", "backward"]),
    "fsdp2-optimizer": (2, 1, {"default_pg"}, ["--stack", "fsdp2", "--slow-where", "optimizer"]),
    "tp-forward": (2, 1, {"default_pg"}, ["--stack", "tp", "--slow-where", "forward"]),
    "tp-sequence-parallel-forward": (2, 0, {"default_pg"}, [
        "--stack", "tp", "--sequence-parallel", "--slow-where", "forward"]),
    "pp-gpipe-forward": (2, 1, {"default_pg"}, ["--stack", "pp", "--schedule", "gpipe"]),
    "pp-1f1b-backward": (2, 0, {"default_pg"}, [
        "--stack", "pp", "--schedule", "1f1b", "--slow-where", "backward"]),
    "pp-interleaved-optimizer": (2, 1, {"default_pg"}, [
        "--stack", "pp", "--schedule", "interleaved", "--slow-where", "optimizer"]),
    "fsdp2-x-tp-forward": (4, 2, {"mesh_dp", "mesh_tp"}, ["--stack", "fsdp2_tp"]),
    "pp-x-fsdp2-forward": (4, 1, {"mesh_pp", "mesh_dp"}, ["--stack", "pp_fsdp2"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_slow_rank_is_named_by_its_compute_on_every_stack(tmp_path: Path, case: str) -> None:
    world, slow, groups, args = CASES[case]
    # The simulated compute must dominate the real work (schedules, FSDP, gloo), which grows
    # under CPU contention and dilutes the 1.3x: 4 ranks on 2 cores, and an interleaved
    # schedule's many small calls, get more.
    compute = "0.6" if world == 4 or "interleaved" in args else "0.4"
    samples = run_job(tmp_path, world, *args, "--slow-rank", str(slow), "--slow-factor", "1.3",
                      "--compute", compute)
    assert_clean(samples, world, groups)
    assert_named(samples, world, slow)


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
                      "--slow-where", "optimizer", "--compute", "0.25")
    assert_clean(samples, 2, {"default_pg"})
    assert_named(samples, 2, 1)


@pytest.mark.parametrize("example", ["train_fsdp2.py", "train_pipeline.py"])
def test_the_examples_train_with_the_one_line(tmp_path: Path, example: str) -> None:
    folder, logs = tmp_path / "metrics", tmp_path / "logs"
    folder.mkdir()
    logs.mkdir()
    script = Path(__file__).resolve().parents[2] / "examples" / example
    with RankJob(2, ["--steps", "6"], script=script, log_dir=logs,
                 env={"ROBUST_METRICS_DIR": str(folder)}, run="example") as job:
        assert job.wait(timeout=120) == [0, 0], job.logs()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    names = {(s.name, s.labels.get("rank")): s.value for f in registry.collect() for s in f.samples
             if not set(s.labels) - {"run", "rank"}}
    assert names[("robust_steps_total", "0")] == names[("robust_steps_total", "1")] == 6
    assert not any(name == "robust_hook_errors_total" for name, _ in names)
