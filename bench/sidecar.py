"""Cost of the node sidecar: scrape latency, resident memory and CPU with 8 ranks publishing.

    .venv/bin/python bench/sidecar.py [--ranks 8] [--scrapes 200] [--interval 15]

Starts a real `robust-metrics sidecar` (all default collectors: on a machine without a GPU, nvml
reports `robust_nvml_up 0`; nic reads the real /sys) and N torch-free rank processes that publish
every rank metric of the schema through the hook's multiprocess sink, stepping every 100 ms. Then:

- latency: N sequential GETs of /metrics, `--spacing` apart so that none is served from the 0.25 s
  snapshot cache, against GETs of /healthz in the same run (the HTTP floor), reported as
  median/p95 and as a ratio to the floor;
- memory: the sidecar's RSS after the scrapes;
- CPU: idle CPU rate (10 s without scrapes) plus CPU per scrape, turned into the fraction of one
  core used at a scrape every `--interval` seconds.

Targets (issue #3): median scrape <= 20 ms, RSS <= 80 MB, < 1% of a core at 15 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from robust_metrics.processes import sidecar as sidecar_service  # noqa: E402
from robust_metrics.processes import spawn  # noqa: E402

WRITER = ROOT / "tests" / "fixtures" / "sidecar" / "rank_writer.py"


def timed_gets(client: httpx.Client, url: str, n: int, spacing: float = 0.0) -> list[float]:
    out = []
    for _ in range(n):
        time.sleep(spacing)
        started = time.perf_counter()
        response = client.get(url)
        out.append(time.perf_counter() - started)
        response.raise_for_status()
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--scrapes", type=int, default=100)
    p.add_argument("--spacing", type=float, default=0.3,
                   help="seconds between scrapes; above the sidecar's 0.25 s snapshot cache, so "
                        "every scrape reads the folder as at a real 15 s interval")
    p.add_argument("--interval", type=float, default=15.0, help="scrape interval to cost CPU at")
    p.add_argument("--idle-seconds", type=float, default=10.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "metrics"
        directory.mkdir()
        writers = []
        try:
            for rank in range(args.ranks):
                proc = spawn(
                    [sys.executable, str(WRITER), "--dir", str(directory), "--rank", str(rank),
                     "--forever", "--interval", "0.1", "--all-metrics", "--steps", "2"],
                    stdout=subprocess.PIPE, cwd=ROOT)
                assert proc.stdout is not None
                proc.stdout.readline()  # "ready"
                writers.append(proc)
            with sidecar_service(directory, log_path=Path(tmp) / "sidecar.log") as sidecar, \
                    httpx.Client(timeout=30) as client:
                me = psutil.Process(sidecar.proc.pid)
                text = client.get(f"{sidecar.url}/metrics").text
                series = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
                rank_series = sum(1 for ln in text.splitlines()
                                  if ln.startswith("robust_") and 'rank="' in ln)
                timed_gets(client, f"{sidecar.url}/metrics", 20)  # warm up
                floor = timed_gets(client, f"{sidecar.url}/healthz", args.scrapes)
                cpu0 = sum(me.cpu_times()[:2])
                lat = timed_gets(client, f"{sidecar.url}/metrics", args.scrapes, args.spacing)
                cpu_per_scrape = (sum(me.cpu_times()[:2]) - cpu0) / args.scrapes
                rss = me.memory_info().rss
                cpu1 = sum(me.cpu_times()[:2])
                time.sleep(args.idle_seconds)
                idle_rate = (sum(me.cpu_times()[:2]) - cpu1) / args.idle_seconds
        finally:
            for proc in writers:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    median, floor_median = statistics.median(lat), statistics.median(floor)
    core = idle_rate + cpu_per_scrape / args.interval
    print(f"ranks={args.ranks} series={series} (rank series {rank_series}) "
          f"scrapes={args.scrapes} cpus={os.cpu_count()}")
    print("| metric | value | target |")
    print("|---|---|---|")
    print(f"| /metrics median | {median * 1e3:.1f} ms | <= 20 ms |")
    print(f"| /metrics p95 | {pct(lat, 0.95) * 1e3:.1f} ms | |")
    print(f"| /healthz median (HTTP floor) | {floor_median * 1e3:.2f} ms | |")
    print(f"| /metrics / floor | {median / floor_median:.1f}x | |")
    print(f"| CPU per scrape | {cpu_per_scrape * 1e3:.1f} ms | |")
    print(f"| idle CPU | {idle_rate * 100:.3f} % of a core | |")
    print(f"| CPU at one scrape per {args.interval:g} s | {core * 100:.2f} % of a core | < 1 % |")
    print(f"| RSS | {rss / 1e6:.1f} MB | <= 80 MB |")


if __name__ == "__main__":
    main()
