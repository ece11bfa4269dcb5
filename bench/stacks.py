"""Cost of hang localisation: py-spy dumps of real ranks, and grouping of many synthetic dumps.

    .venv/bin/python bench/stacks.py [--ranks 8] [--synthetic 16384] [--repeat 5]

1. Starts `--ranks` real gloo ranks of tests/stacks_train.py (one blocked in data loading, the
   others waiting in all_reduce, as in a hang) and times `dump_stacks` of all of them at once,
   against dumping one rank alone and the ranks one after the other in the same run.
2. Builds `--synthetic` rank dumps shaped like real ones (a 30-frame main thread plus two helper
   threads, nodes of 8 ranks, dp/pp/tp topology, one outlier rank) and times `analyse` on one
   sample and on three, against `json.loads` of the same dumps (the floor any consumer pays).

Prints a Markdown table for bench/README.md. Targets (issue #8): 8 ranks <= 2 s; 16,384 dumps
grouped <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from robust_metrics.analysis.stacks import analyse  # noqa: E402
from robust_metrics.processes import RankJob, wait_for  # noqa: E402
from robust_metrics.sidecar.stacks import dump_stacks, find_py_spy  # noqa: E402

SITE = "/opt/venv/lib/python3.11/site-packages"


def timed(fn, repeat: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def bench_dumps(nranks: int, repeat: int) -> list[tuple[str, str, str]]:
    if find_py_spy() is None:
        return [("dump", "py-spy not installed", "-")]
    rows = []
    with tempfile.TemporaryDirectory() as logs, RankJob(
            nranks, ["--data-stall-rank", str(nranks - 1)],
            script=ROOT / "tests" / "stacks_train.py", log_dir=Path(logs)) as job:
        wait_for(lambda: "stalled in load_batch" in job.logs(), timeout=300,
                   message="the stalled rank")
        time.sleep(1.0)
        one, _ = timed(lambda: dump_stacks(job.pids[:1]), repeat)
        serial, _ = timed(lambda: [dump_stacks([pid]) for pid in job.pids], repeat)
        for locals_ in (False, True):
            all_, result = timed(lambda locals_=locals_: dump_stacks(job.pids, locals_=locals_),
                                 repeat)
            errors = [d["error"] for d in result if d["error"]]  # type: ignore[union-attr]
            assert not errors, errors
            rows.append((f"dump {nranks} real ranks concurrently"
                         + (" with locals" if locals_ else ""),
                         f"{all_:.3f} s", f"{all_ / one:.1f}x one rank ({one:.3f} s), "
                         f"{all_ / serial:.2f}x one after the other ({serial:.3f} s)"))
        report = analyse([{**d, "rank": r} for r, d in enumerate(result)])  # type: ignore[arg-type]
        assert report["suspect_ranks"] == [nranks - 1], report["suspect_ranks"]
    return rows


def synthetic(n: int, samples: int, outlier: int) -> list[dict]:
    model = [(f"forward_{i}", f"{SITE}/torch/nn/modules/layer{i % 7}.py") for i in range(24)]
    wait = [("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py"),
            ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py"),
            ("_sync_params", f"{SITE}/torch/nn/parallel/distributed.py"), *model[:20],
            ("train_step", "/job/train.py"), ("main", "/job/train.py"),
            ("<module>", "/job/train.py")]
    stall = [("_read_from_slow_storage", "/job/data.py"), ("load_batch", "/job/data.py"),
             *wait[3:]]
    helpers = [[("wait", "/usr/lib/python3.11/threading.py"),
                ("_flush_loop", f"{SITE}/robust_metrics/hooks/sinks.py"),
                ("run", "/usr/lib/python3.11/threading.py")],
               [("_pin_memory_loop", f"{SITE}/torch/utils/data/_utils/pin_memory.py"),
                ("run", "/usr/lib/python3.11/threading.py")]]
    out = []
    for _ in range(samples):
        for r in range(n):
            rng = random.Random(r)  # the same lines in every sample: a hung job
            main = stall if r == outlier else wait
            threads = [{"thread_id": 1, "os_thread_id": 100000 + r, "thread_name": "MainThread",
                        "idle": True, "frames": [{"function": f, "file": p,
                                                  "line": rng.randint(1, 900)}
                                                 for f, p in main]}]
            for i, h in enumerate(helpers):
                threads.append({"thread_id": 2 + i, "os_thread_id": 0,
                                "thread_name": f"Thread-{i + 1}", "idle": True,
                                "frames": [{"function": f, "file": p, "line": 10}
                                           for f, p in h]})
            out.append({"run": "bench", "rank": r, "pid": 100000 + r, "node": f"n{r // 8}",
                        "threads": threads, "error": None})
    return out


def bench_grouping(n: int, repeat: int) -> list[tuple[str, str, str]]:
    info = {r: {"node": f"n{r // 8}", "world_size": n, "dp_rank": r // 64,
                "pp_rank": (r // 8) % 8, "tp_rank": r % 8} for r in range(n)}
    rows = []
    for samples in (1, 3):
        dumps = synthetic(n, samples, outlier=n // 3)
        text = json.dumps(dumps)
        parse, _ = timed(lambda text=text: json.loads(text), repeat)
        group, report = timed(lambda dumps=dumps: analyse(dumps, info), repeat)
        assert report["suspect_ranks"] == [n // 3], report["suspect_ranks"]  # type: ignore[index]
        rows.append((f"group {n:,} synthetic dumps x {samples} sample(s) "
                     f"({len(text) / 2**20:.0f} MiB JSON)", f"{group:.3f} s",
                     f"{group / parse:.2f}x json.loads of the same ({parse:.3f} s)"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--synthetic", type=int, default=16384)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    rows = bench_dumps(args.ranks, args.repeat) + bench_grouping(args.synthetic, args.repeat)
    print("| case | median time | against baseline |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
