"""The pytest fixture around bench/slurm_cluster.py: one real single-node Slurm per test module."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.slurm_cluster import SlurmCluster, missing_binaries

__all__ = ["job_log", "job_report", "slurm_cluster"]


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One cluster per test module that imports this fixture (about 3 s to start, 1 s to stop).

    Skips only where the packages are missing or the tests do not run as root; a cluster that
    is installed but does not start is an error, with the daemons' logs.
    """
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing): scripts/"
                    "install-system-deps.sh installs slurm-wlm slurmrestd slurm-wlm-jwt-plugin munge")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm runs its daemons as root (SlurmUser=root); run as root")
    with tempfile.TemporaryDirectory(prefix="rm-slurm-") as tmp:
        cluster = SlurmCluster(Path(tmp))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


def job_log(path: Path) -> str:
    """A batch job's output so far ('' before Slurm created the file)."""
    return path.read_text(errors="replace") if path.exists() else ""


def job_report(cluster: SlurmCluster, job: str, log: Path) -> str:
    """What a failed wait on a batch job prints: its output so far and `scontrol show job`."""
    return f"{job_log(log)}\n{cluster.cli('scontrol', 'show', 'job', job, check=False)}"
