"""Slurm adapter benchmark: how long each operation takes, slurmrestd against the CLI fallback.

Starts a single-node Slurm (bench/slurm_cluster.py: munged, slurmctld, slurmd, slurmrestd),
runs one job that traps SIGUSR1, and times the adapter's operations. That rig lives here rather
than in the harness (robust_metrics/processes.py) because it runs the daemons as root with their
security off, which the product package must not ship; it is built on the harness, and the Slurm
tests start the same daemons through it. Baseline: a
slurmrestd GET /ping on the same server, so the figures are ratios that survive a busy machine.
The figures are per call of the adapter, as the bridge makes them (a fresh HTTP connection or
a fresh `scancel` process each time).

Run as root where the Slurm packages are installed: .venv/bin/python bench/schedulers.py [-n 30]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.slurm_cluster import SlurmCluster, missing_binaries  # noqa: E402
from robust_metrics.bridge.schedulers.slurm import SlurmScheduler  # noqa: E402


def timed(fn: Callable[[], object], n: int) -> float:
    """Median seconds of `n` calls."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-n", type=int, default=30, help="calls per operation")
    args = p.parse_args()
    if missing_binaries() or os.geteuid() != 0:
        print(f"skipped: needs root and Slurm ({', '.join(missing_binaries()) or 'not root'})")
        return 0
    with tempfile.TemporaryDirectory(prefix="rm-slurm-bench-") as tmp:
        t0 = time.perf_counter()
        cluster = SlurmCluster(Path(tmp)).start()
        started = time.perf_counter() - t0
        try:
            token = Path(tmp) / "jwt"
            token.write_text(cluster.token())
            rest = SlurmScheduler({"url": cluster.rest_url, "user": "root",
                                   "token_file": str(token), "slurm_conf": str(cluster.conf)})
            cli = SlurmScheduler({"slurm_conf": str(cluster.conf)})
            script = Path(tmp) / "trap.sh"
            script.write_text("#!/bin/bash\ntrap 'n=$((n+1))' USR1\n"
                              "while :; do sleep 0.05; done\n")
            job = cluster.sbatch(script, "--output=/dev/null", "--requeue")
            while cluster.job_field(job, "JobState") != "RUNNING":
                time.sleep(0.1)
            ping = timed(lambda: rest._rest("GET", "/ping"), args.n)
            rows = [
                ("slurmrestd GET /ping (baseline)", ping),
                ("signal via slurmrestd", timed(lambda: rest.signal(job, signal.SIGUSR1),
                                                args.n)),
                ("signal via scancel --full", timed(lambda: cli.signal(job, signal.SIGUSR1),
                                                    args.n)),
                ("job lookup via slurmrestd", timed(lambda: rest.job(job), args.n)),
                ("drain_node via scontrol", timed(lambda: cli.drain_node(cluster.node, "bench"),
                                                  args.n)),
                ("restart (scontrol requeue)", timed(lambda: rest.restart(job, "bench"), 1)),
            ]
            cluster.cli("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME")
        finally:
            cluster.stop()
    print(f"single-node Slurm fixture start: {started:.2f} s; median of {args.n} calls "
          "(restart: one call)\n")
    print("| operation | median | x ping |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1000:.1f} ms | {seconds / ping:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
