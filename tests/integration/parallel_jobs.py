"""Real gloo jobs of `robust_metrics/workloads/parallel_job.py` (FSDP2, tensor parallelism,
pipeline schedules, 2-D meshes, torch.compile) with one `watch()` line, and how the tests read
what `watch()` wrote: prometheus_client's own MultiProcessCollector over the rank folder.
Shared by the tests of each parallelism (test_parallelism_gloo.py, test_slow_rank_*_gloo.py, and
test_parallelism_gpu.py on a GPU)."""

from __future__ import annotations

import statistics
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from robust_metrics import workloads
from robust_metrics.processes import RankJob

JOB = Path(workloads.__file__).resolve().parent / "parallel_job.py"
STEPS = 16


def run_job(tmp_path: Path, world: int, *args: str, steps: int = STEPS,
            env: dict[str, str] | None = None,
            script: Path = JOB) -> dict[str, list[tuple[str, dict, float]]]:
    """Run the job (or another training script taking `--steps`) to its end; its samples by
    rank: (name, labels without run and rank, value)."""
    folder, logs = tmp_path / "metrics", tmp_path / "logs"
    folder.mkdir()
    logs.mkdir()
    with RankJob(world, ["--steps", str(steps), *args], script=script, log_dir=logs,
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


def assert_named(samples: dict, world: int, slow: int, extra: float) -> None:
    """The slowed rank's compute per step exceeds the median of the other ranks' by at least
    half the `extra` seconds it was slowed by, and no other rank's by more than a third of it.
    A difference, not a ratio: the real work (schedules, FSDP, gloo) adds to every rank's
    compute alike, and adds more under CPU contention; what was slowed must show as compute on
    the slowed rank and as waiting on the others. Half, not all: in a pipeline the other ranks
    are other stages, whose real work differs (the last computes the loss), and a slowed stage
    waits less for its neighbour (a 1F1B first stage slowed by 0.12 s showed 0.079 s more
    compute than the last on a loaded machine)."""
    computes = [mean_compute(samples, r) for r in range(world)]
    median = statistics.median(c for r, c in enumerate(computes) if r != slow)
    excess = [c - median for c in computes]
    report = f"compute per step {computes}, slowed rank {slow} by {extra} s"
    assert excess[slow] >= extra / 2, report
    assert all(e <= extra / 3 for i, e in enumerate(excess) if i != slow), report


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


# The slow-rank cases, by stack.
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


def run_slow_rank_case(tmp_path: Path, case: str) -> None:
    """One case of CASES: the slowed rank is named by its compute, and the job is clean."""
    world, slow, groups, args = CASES[case]
    # The slowdown (0.3 x the simulated compute per step) must stand out from the jitter of
    # the real work (schedules, FSDP, gloo), which grows under CPU contention: 4 ranks on 2
    # cores get more (ranks of one stage parted by 0.08 s per step on a loaded machine), and
    # so does an interleaved schedule's many small calls.
    compute = 1.0 if world == 4 else 0.6 if "interleaved" in args else 0.4
    samples = run_job(tmp_path, world, *args, "--slow-rank", str(slow), "--slow-factor", "1.3",
                      "--compute", str(compute))
    assert_clean(samples, world, groups)
    assert_named(samples, world, slow, extra=0.3 * compute)
