"""`robust-metrics demo`: train on gloo ranks with the hook and show what was published.

Runs `examples/train_ddp.py` on N local ranks with `ROBUST_METRICS_DIR` set, reads the ranks'
multiprocess files back as the sidecar would, and prints one row per rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from robust_metrics.tables import render_table

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks to start (default 2)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="make this rank slow, to see the straggler signal (default: none)")
    parser.add_argument("--dir", default="", help="metrics folder (default: a temporary one)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    if not EXAMPLE.exists():
        print(f"demo: {EXAMPLE} not found; run the demo from a source checkout", file=sys.stderr)
        return 2
    if args.ranks < 1:
        print("demo: --ranks must be >= 1", file=sys.stderr)
        return 2
    folder = args.dir or tempfile.mkdtemp(prefix="robust-metrics-demo-")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(args.ranks), "ROBUST_METRICS_DIR": folder,
           "ROBUST_METRICS_RUN": "demo", "OMP_NUM_THREADS": "1"}
    print(f"training {args.steps} steps on {args.ranks} gloo ranks; metrics in {folder}")
    procs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", str(args.steps),
                               "--slow-rank", str(args.slow_rank), "--slow-seconds", "0.01"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(args.ranks)]
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        return 130
    if any(codes):
        print(f"demo: training failed with exit codes {codes}", file=sys.stderr)
        return 1
    print(summarise(folder))
    return 0


def summarise(folder: str) -> str:
    """One row per rank of what the sidecar would serve from `folder`."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    by_rank: dict[str, dict[str, float]] = {}
    series = 0
    for family in registry.collect():
        for s in family.samples:
            series += 1
            if "rank" in s.labels and s.labels.get("op", "all_reduce") == "all_reduce":
                by_rank.setdefault(s.labels["rank"], {})[s.name] = s.value
    rows = []
    for rank in sorted(by_rank, key=int):
        v = by_rank[rank]
        steps = v.get("robust_step_duration_seconds_count", 0) or 1
        step_ms = 1000 * v.get("robust_step_duration_seconds_sum", 0) / steps
        compute_ms = 1000 * v.get("robust_step_compute_seconds_sum", 0) / steps
        coll = v.get("robust_collective_duration_seconds_count", 0) or 1
        rows.append([rank, f"{v.get('robust_steps_total', 0):.0f}", f"{step_ms:.2f}",
                     f"{compute_ms:.2f}", f"{step_ms - compute_ms:.2f}",
                     f"{1000 * v.get('robust_collective_duration_seconds_sum', 0) / coll:.2f}",
                     f"{v.get('robust_loss', float('nan')):.4f}",
                     f"{v.get('robust_grad_norm', float('nan')):.4f}",
                     f"{v.get('robust_nonfinite_loss_steps_total', 0):.0f}"])
    header = ["rank", "steps", "step ms", "compute ms", "blocked ms", "all_reduce ms", "loss",
              "grad norm", "NaN steps"]
    return (render_table(header, rows) +
            f"\n{series} series published by {len(rows)} ranks "
            f"({series / max(len(rows), 1):.0f} per rank). Compute = step time minus time blocked "
            "in collectives: a straggler computes most and waits least.")
