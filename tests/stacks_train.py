"""A gloo training loop whose ranks can block in recognisable functions, for the stack tests.

Each step: `load_batch` -> forward/backward -> `sync_gradients` (one all_reduce per parameter) ->
optimizer step -> `save_checkpoint` every `--checkpoint-every` steps. At `--stall-step`:

  --data-stall-rank R   rank R blocks in load_batch -> _read_from_slow_storage (its peers then
                        wait in all_reduce)
  --ckpt-stall-rank R   rank R blocks in save_checkpoint -> _flush_to_remote_storage at
                        --ckpt-stall-step (default: --stall-step; the checkpoint comes after the
                        step's all_reduce, so use an earlier step to combine it with a data stall)
  --compute-stall-rank R
                        rank R computes forever in load_batch -> _retry_bad_batch (its stack
                        moves: new locals on every sample, unlike a rank that sleeps)
  --ddp                 wrap the model in DistributedDataParallel: gradients are reduced inside
                        backward (C++), so a waiting rank shows no torch.distributed frame
  --deadlock            every rank enters an all_reduce on one of two process groups, split in
                        half, so all of them wait in the same collective and nobody is elsewhere

Each rank prints `rank R: step N` every 20 steps and `rank R: stalled in X` once it blocks. With
ROBUST_METRICS_DIR set the robust-metrics hook runs in multiprocess mode and writes
`ranks/<pid>.json`, so a sidecar (or `robust-metrics stacks --metrics-dir`) can find the ranks.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from robust_metrics.workloads.ending import exit_process


def _read_from_slow_storage(rank: int) -> None:
    print(f"rank {rank}: stalled in load_batch", flush=True)
    while True:
        time.sleep(0.5)


def _retry_bad_batch(rank: int) -> None:
    print(f"rank {rank}: stalled in compute", flush=True)
    x = torch.randn(64, 64)
    attempt = 0
    while True:
        attempt += 1
        x = torch.tanh(x @ x)
        time.sleep(0.01)  # a busy rank, but gentle on a shared CPU


def load_batch(step: int, rank: int, stall: bool, generator: torch.Generator,
               spin: bool = False) -> torch.Tensor:
    if stall:
        _read_from_slow_storage(rank)
    if spin:
        _retry_bad_batch(rank)
    return torch.randn(32, 64, generator=generator)


def _flush_to_remote_storage(rank: int) -> None:
    print(f"rank {rank}: stalled in save_checkpoint", flush=True)
    while True:
        time.sleep(0.5)


def save_checkpoint(model: nn.Module, rank: int, stall: bool) -> None:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if stall:
        _flush_to_remote_storage(rank)
    del state


def sync_gradients(model: nn.Module) -> None:
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def _exchange(rank: int, group: dist.ProcessGroup) -> None:
    print(f"rank {rank}: stalled in deadlock", flush=True)
    dist.all_reduce(torch.ones(4), group=group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--stall-step", type=int, default=5)
    p.add_argument("--data-stall-rank", type=int, default=-1)
    p.add_argument("--ckpt-stall-rank", type=int, default=-1)
    p.add_argument("--compute-stall-rank", type=int, default=-1)
    p.add_argument("--ckpt-stall-step", type=int, default=-1)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--deadlock", action="store_true")
    p.add_argument("--ddp", action="store_true")
    args = p.parse_args()
    if args.ckpt_stall_step < 0:
        args.ckpt_stall_step = args.stall_step
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    halves = [dist.new_group(list(range(world))) for _ in range(2)]
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = None
    if os.environ.get("ROBUST_METRICS_DIR"):
        import robust_metrics

        # a made-up 2 x 2 layout, so that tests can check the topology reaches every report
        handle = robust_metrics.watch(model, optimizer, topology={
            "dp_rank": rank % 2, "pp_rank": 0, "tp_rank": rank // 2})
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        at_stall = step == args.stall_step
        if at_stall and args.deadlock:
            _exchange(rank, halves[0] if rank < world // 2 else halves[1])
        x = load_batch(step, rank, at_stall and rank == args.data_stall_rank, generator,
                       at_stall and rank == args.compute_stall_rank)
        loss = model(x).pow(2).mean()
        loss.backward()
        if not args.ddp:
            sync_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ckpt_stall = step == args.ckpt_stall_step and rank == args.ckpt_stall_rank
        if (args.checkpoint_every and step % args.checkpoint_every == 0) or ckpt_stall:
            save_checkpoint(model, rank, ckpt_stall)
        if step % 20 == 0:
            print(f"rank {rank}: step {step}", flush=True)
    if handle is not None:
        handle.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
