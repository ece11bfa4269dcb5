"""A pipeline-parallel job (torch.distributed.pipelining) with the one robust-metrics line.

    torchrun --nproc-per-node 2 examples/train_pipeline.py --schedule 1f1b

Each rank builds its stage and passes the stage to `watch()` (under an interleaved schedule, the
list of its stages): the hook times each micro-batch's forward, the send/recv waits as blocked
time (counted per pair of neighbouring ranks, so a hang names the stage that stopped), and takes
pp_rank from the stage.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import robust_metrics
from robust_metrics.workloads.ending import exit_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    last = rank == world - 1
    layers: list[nn.Module] = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)]
    module = nn.Sequential(*layers, *([nn.Linear(64, 1)] if last else []))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, args.microbatches, loss_fn=lambda out, y: (out - y).pow(2).mean())
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    with robust_metrics.watch(stage, optimizer):  # the one line
        for _ in range(args.steps):
            x, y = torch.randn(8 * args.microbatches, 64), torch.zeros(8 * args.microbatches, 1)
            if rank == 0:
                schedule.step(x, target=y if last else None)
            elif last:
                schedule.step(target=y)
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
