"""The hook in a real 4-rank gloo DDP job on the CPU, in both publishing modes."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from robust_metrics import schema
from tests.support import RankJob, free_port_block, wait_until

WORLD = 4
SLOW, NAN = 3, 1


@pytest.fixture(scope="module")
def faulty_job(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """One job, one slow rank and one NaN loss; returns samples by (name, rank)."""
    folder = tmp_path_factory.mktemp("metrics")
    logs = tmp_path_factory.mktemp("logs")
    with RankJob(WORLD, ["--steps", "30", "--slow-rank", str(SLOW), "--slow-seconds", "0.03",
                         "--nan-rank", str(NAN), "--nan-step", "10"],
                 env={"ROBUST_METRICS_DIR": str(folder)}, log_dir=logs, run="gloo") as job:
        codes = job.wait(timeout=180)
        assert codes == [0] * WORLD, job.logs()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    samples: dict[tuple[str, str], dict] = {}
    for family in registry.collect():
        for s in family.samples:
            samples.setdefault((s.name, s.labels.get("rank", "")), {})[
                tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "rank")))
            ] = s.value
    return samples


def one(samples: dict, name: str, rank: int, **labels: str) -> float:
    return samples[(name, str(rank))][tuple(sorted(labels.items()))]


def test_every_rank_publishes_the_core_series(faulty_job: dict) -> None:
    for rank in range(WORLD):
        assert one(faulty_job, "robust_steps_total", rank) == 30
        assert one(faulty_job, "robust_global_step", rank) == 30
        assert one(faulty_job, "robust_step_duration_seconds_count", rank) == 30
        assert one(faulty_job, "robust_step_compute_seconds_count", rank) == 30
        assert one(faulty_job, "robust_last_step_timestamp_seconds", rank) > 1.7e9
        assert one(faulty_job, "robust_grad_norm", rank) > 0
        assert 0 < one(faulty_job, "robust_loss", rank) < 100
        count = one(faulty_job, "robust_collective_duration_seconds_count", rank,
                    op="all_reduce", group="default_pg")
        assert count >= 30  # DDP's reduction, once per step
        assert one(faulty_job, "robust_collectives_entered_total", rank, group="default_pg") == \
            one(faulty_job, "robust_collectives_completed_total", rank, group="default_pg")
        assert one(faulty_job, "robust_collective_bytes_total", rank, op="all_reduce",
                   group="default_pg") > 0
        assert ("robust_rank_info", str(rank)) in faulty_job


def test_the_slow_rank_computes_most_and_waits_least(faulty_job: dict) -> None:
    compute = {r: one(faulty_job, "robust_step_compute_seconds_sum", r) for r in range(WORLD)}
    blocked = {r: one(faulty_job, "robust_step_duration_seconds_sum", r) - compute[r]
               for r in range(WORLD)}
    assert max(compute, key=compute.__getitem__) == SLOW, compute
    assert min(blocked, key=blocked.__getitem__) == SLOW, blocked
    collective = {r: one(faulty_job, "robust_collective_duration_seconds_sum", r,
                         op="all_reduce", group="default_pg") for r in range(WORLD)}
    assert min(collective, key=collective.__getitem__) == SLOW, collective


def test_a_nan_loss_counts_once_on_its_rank_only(faulty_job: dict) -> None:
    counts = {r: one(faulty_job, "robust_nonfinite_loss_steps_total", r) for r in range(WORLD)}
    assert counts == {0: 0, 1: 1, 2: 0, 3: 0}
    # all-reduce spreads the NaN gradients to every rank: each sees one non-finite step
    grads = {r: one(faulty_job, "robust_nonfinite_grad_steps_total", r) for r in range(WORLD)}
    assert grads == {0: 1, 1: 1, 2: 1, 3: 1}


def test_series_per_rank_stay_within_budget(faulty_job: dict) -> None:
    per_rank = sum(len(v) for (name, rank), v in faulty_job.items() if rank == "0")
    assert per_rank <= 40, per_rank


def test_in_process_endpoints_serve_every_rank(tmp_path: Path) -> None:
    port = free_port_block(2)
    with RankJob(2, ["--steps", "100000", "--step-sleep", "0.01"],
                 env={"ROBUST_METRICS_PORT": str(port)}, log_dir=tmp_path, run="http") as job:
        for local_rank in range(2):
            url = f"http://127.0.0.1:{port + local_rank}/metrics"

            def scraped(url: str = url) -> dict[str, float]:
                text = urllib.request.urlopen(url, timeout=2).read().decode()
                values = {s.name: s.value for f in text_string_to_metric_families(text)
                          for s in f.samples if s.labels.get("run") == "http"}
                return values if values.get("robust_steps_total", 0) >= 5 else {}

            values = wait_until(scraped, timeout=60,
                                message=lambda url=url: f"5 steps on {url}\n{job.logs()}")
            for spec in (schema.STEPS_TOTAL, schema.LAST_STEP_TIMESTAMP, schema.LOSS,
                         schema.GRAD_NORM, schema.NONFINITE_LOSS, schema.NONFINITE_GRAD):
                assert spec.name in values, spec.name
            assert "robust_step_compute_seconds_count" in values


def test_flops_per_step_counts_model_flops_on_every_rank_within_the_budget(
        tmp_path: Path) -> None:
    """Two gloo ranks with watch(flops_per_step=...): the counter, and the series it costs."""
    folder, steps, flops = tmp_path / "metrics", 12, 3.5e9
    folder.mkdir()
    with RankJob(2, ["--steps", str(steps), "--flops-per-step", str(flops)],
                 env={"ROBUST_METRICS_DIR": str(folder)}, log_dir=tmp_path, run="flops") as job:
        assert job.wait(timeout=180) == [0, 0], job.logs()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))
    per_rank: dict[str, int] = {}
    counted: dict[str, float] = {}
    for family in registry.collect():
        for s in family.samples:
            rank = s.labels.get("rank", "")
            per_rank[rank] = per_rank.get(rank, 0) + 1
            if s.name == schema.MODEL_FLOPS.name:
                counted[rank] = s.value
    assert counted == {"0": steps * flops, "1": steps * flops}
    assert per_rank["0"] <= 40, per_rank
    print(f"series per rank with flops_per_step: {per_rank}")
