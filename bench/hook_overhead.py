"""Hook overhead: CPU time the hook adds per training step, against the same loop without it.

A tiny DDP model on a 1-rank gloo group (so collective timing and the DDP comm hook are on the
path) with ~1 ms steps. Baseline and hooked runs alternate in the same process, several rounds;
the figure is the median over rounds of (hooked - baseline) CPU seconds per step. Run:

    .venv/bin/python bench/hook_overhead.py [--steps 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import robust_metrics


def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
         clip: bool) -> tuple[float, float]:
    """Run one pass over `batches`; return (CPU seconds, wall seconds)."""
    cpu, wall = time.process_time(), time.perf_counter()
    for x in batches:
        loss = model(x).pow(2).mean()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.process_time() - cpu, time.perf_counter() - wall


def measure(backend: str, clip: bool, steps: int, rounds: int, folder: str) -> dict[str, float]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(64, 256) for _ in range(steps)]
    loop(model, optimizer, batches[:200], clip)  # warm-up
    added, base_steps = [], []
    for _ in range(rounds):
        base_cpu, base_wall = loop(model, optimizer, batches, clip)
        options = {"backend": backend, "run": "bench", "port": 19750}
        if backend == "multiprocess":
            options["metrics_dir"] = folder
        with robust_metrics.watch(model, optimizer, **options):
            hook_cpu, _ = loop(model, optimizer, batches, clip)
        added.append((hook_cpu - base_cpu) / steps)
        base_steps.append(base_wall / steps)
    step = statistics.median(base_steps)
    extra = statistics.median(added)
    return {"step_ms": 1000 * step, "added_us": 1e6 * extra, "ratio_1ms": extra / step,
            "ratio_10ms": extra / 0.010}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    folder = tempfile.mkdtemp(prefix="robust-bench-")
    print("| backend | clip_grad_norm_ | baseline step | added CPU per step | of a 1 ms step "
          "| of a 10 ms step |")
    print("|---|---|---|---|---|---|")
    for backend in ("multiprocess", "http"):
        for clip in (True, False):
            r = measure(backend, clip, args.steps, args.rounds, folder)
            print(f"| {backend} | {'yes' if clip else 'no (hook computes the norm)'} | "
                  f"{r['step_ms']:.2f} ms | {r['added_us']:.1f} µs | {100 * r['ratio_1ms']:.2f}% | "
                  f"{100 * r['ratio_10ms']:.2f}% |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
