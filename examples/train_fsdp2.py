"""FSDP2 (optionally with tensor parallelism on a 2-D mesh) with the one robust-metrics line.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py            # FSDP2 over 2 ranks
    torchrun --nproc-per-node 4 examples/train_fsdp2.py --tp 2     # FSDP2 x TP on a (2, 2) mesh

On GPUs use backend nccl and device cuda; here it runs on the CPU with gloo. `watch()` times
FSDP's all-gathers and reduce-scatters (and the tensor-parallel collectives) as blocked time and
takes dp_rank/tp_rank from the DeviceMesh.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import robust_metrics
from robust_metrics.workloads.ending import exit_process


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(*(Block(64) for _ in range(4)))
    for block in model:
        if args.tp > 1:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                                   "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    with robust_metrics.watch(model, optimizer):  # the one line
        for _ in range(args.steps):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
