"""The README's series count per rank is what a real CPU DDP job costs through the sidecar.

A 2-rank gloo job of `examples/train_ddp.py` with the hook writes its rank folder, a real
`robust-metrics sidecar` serves it (its own per-rank series, liveness, process and identity,
included), and every sample of the scrape that carries the run's `run` and `rank` labels counts.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT, RankJob, SidecarProcess, wait_until

RUN = "series"


def per_rank(text: str) -> tuple[Counter[str], dict[str, float]]:
    """Samples of the run per rank, and each rank's steps."""
    counts: Counter[str] = Counter()
    steps: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run") != RUN or "rank" not in sample.labels:
                continue
            counts[sample.labels["rank"]] += 1
            if sample.name == "robust_steps_total":
                steps[sample.labels["rank"]] = sample.value
    return counts, steps


def readme_count() -> int:
    found = re.search(r"\((\d+) series per\s+rank scraped from the sidecar on a CPU DDP job",
                      (ROOT / "README.md").read_text())
    assert found, "README: '(N series per rank scraped from the sidecar on a CPU DDP job'"
    return int(found.group(1))


def test_a_cpu_ddp_rank_costs_the_series_the_readme_says(tmp_path: Path) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    token = tmp_path / "token"
    token.write_text("series-token")
    with SidecarProcess(folder, ["--token-file", str(token)],
                        log_path=tmp_path / "sidecar.log") as sidecar, \
            RankJob(2, ["--steps", "100000", "--step-sleep", "0.05"],
                    env={"ROBUST_METRICS_DIR": str(folder)}, log_dir=tmp_path, run=RUN) as job:

        def stepping() -> Counter[str] | None:
            counts, steps = per_rank(httpx.get(f"{sidecar.url}/metrics", timeout=10).text)
            return counts if len(steps) == 2 and min(steps.values()) >= 20 else None

        counts = wait_until(stepping, timeout=180, message=lambda: f"20 steps\n{job.logs()}")
    assert counts["0"] == counts["1"] == readme_count(), counts
    assert counts["0"] <= 40  # the default budget (docs/sizing.md)
