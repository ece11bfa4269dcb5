"""A gloo job with a (dp, pp) topology for straggler attribution tests.

Rank r is DP rank r % dp of pipeline stage r // dp. Pipeline stages are simulated by their compute
time: each stage's forward sleeps its own seconds (no activations cross stages). As in a
Megatron-style job, gradients are all-reduced over the stage's DP group (DDP) and the gradient
norm over all ranks (`optimizer-clip-main-grad`), which ends every stage's step together. The
hook records metrics (in-process /metrics) and, with TRACE_DIR set, what-if op traces.

    python tests/attribution_job.py --dp 2 --pp 2 --base 0.02 --stage-extra 0,0.04
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import robust_metrics
from robust_metrics.hooks.trace import span
from robust_metrics.workloads.ending import exit_process


class StageModel(nn.Module):
    """A tiny layer whose forward takes `seconds` (the stage's and this worker's compute)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.net = nn.Linear(32, 32)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.net(x)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--base", type=float, default=0.02, help="forward seconds of every rank")
    p.add_argument("--stage-extra", default="", help="extra seconds per stage, comma-separated")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-extra", type=float, default=0.0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == args.dp * args.pp, f"world size {world} != dp {args.dp} x pp {args.pp}"
    stage, dp_rank = divmod(rank, args.dp)
    groups = [dist.new_group(list(range(s * args.dp, (s + 1) * args.dp))) for s in range(args.pp)]
    extra = [float(v) for v in args.stage_extra.split(",")] if args.stage_extra else []
    seconds = args.base + (extra[stage] if stage < len(extra) else 0.0)
    seconds += args.slow_extra if rank == args.slow_rank else 0.0
    torch.manual_seed(0)
    model = StageModel(seconds)
    ddp = DDP(model, process_group=groups[stage])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    trace = os.environ.get("TRACE_DIR")
    handle = robust_metrics.watch(
        ddp, optimizer, topology={"dp_rank": dp_rank, "pp_rank": stage, "tp_rank": 0},
        checkpoint_signal=None, trace_dir=trace,
        trace_every=int(os.environ.get("TRACE_EVERY", "0")) if trace else 0)
    generator = torch.Generator().manual_seed(rank)
    with handle:
        for _ in range(args.steps):
            ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
            with span("optimizer-clip-main-grad"):
                norm = torch.stack([p.grad.pow(2).sum() for p in ddp.parameters()]).sum()
                dist.all_reduce(norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
