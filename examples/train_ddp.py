"""A small DDP training job on gloo with the robust-metrics hook.

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 50

Fault injection for tests and the demo, by environment or options:
  --slow-rank R --slow-seconds S   sleep S seconds in rank R's forward every step
  --nan-rank R --nan-step N        make rank R's loss NaN at step N
  --hang-rank R --hang-step N      rank R sleeps forever at step N (its peers wait in all_reduce)
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
from robust_metrics.workloads.ending import exit_process


class TinyModel(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.slow_seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_seconds:
            time.sleep(self.slow_seconds)
        return self.net(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm (0: off)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-seconds", type=float, default=0.05)
    p.add_argument("--nan-rank", type=int, default=-1)
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--nan-once", action="store_true",
                   help="the NaN of --nan-step only in the first process that reaches it (a "
                        "machine fault: a marker in --checkpoint-dir), not again after a resume")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--checkpoint-dir", default="", help="save and resume checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save a checkpoint every N steps (0: only on request)")
    p.add_argument("--checkpoint-seconds", type=float, default=0.0,
                   help="each checkpoint also takes this long, as on a slow filesystem")
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=-1,
                   help="the crash rank raises at this step, after every restart too")
    p.add_argument("--flops-per-step", type=float, default=0.0,
                   help="model FLOPs per optimizer step for MFU (watch(flops_per_step=); 0: off)")
    p.add_argument("--summary", action="store_true", help="print the published metrics at the end")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyModel(args.width)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    start = 0
    ckpt_path = os.path.join(args.checkpoint_dir, "checkpoint.pt") if args.checkpoint_dir else ""
    if ckpt_path and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"rank {rank}: resumed from step {start}", flush=True)

    def save_checkpoint(step: int) -> None:
        if ckpt_path and rank == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        time.sleep(args.checkpoint_seconds)
        print(f"rank {rank}: checkpoint at step {step}", flush=True)

    handle = robust_metrics.watch(ddp, optimizer, checkpoint=save_checkpoint, start_step=start,
                                  flops_per_step=args.flops_per_step or None)
    if rank == args.slow_rank:
        model.slow_seconds = args.slow_seconds
    generator = torch.Generator().manual_seed(rank)
    with handle:
        for step in range(start, args.steps):
            if rank == args.hang_rank and step == args.hang_step:
                print(f"rank {rank}: hanging at step {step}", flush=True)
                while True:
                    time.sleep(1)
            if rank == args.crash_rank and step == args.crash_step:
                raise RuntimeError(f"rank {rank}: injected crash at step {step}")
            for _ in range(args.accumulate):
                x = torch.randn(16, args.width, generator=generator)
                loss = ddp(x).pow(2).mean() / args.accumulate
                if rank == args.nan_rank and step == args.nan_step and _nan_now(args):
                    loss = loss * float("nan")
                loss.backward()
            if args.clip:
                norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
                if not torch.isfinite(norm):  # skip the update, as AMP's GradScaler does
                    for p in ddp.parameters():
                        p.grad.zero_()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                with handle.phase("checkpoint"):
                    save_checkpoint(step + 1)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        if args.summary:
            print_summary(handle, rank)
    dist.destroy_process_group()


def _nan_now(args: argparse.Namespace) -> bool:
    """Whether to inject the NaN: always (it follows the data), or with --nan-once only the first
    time, as a fault of the machine would."""
    if not args.nan_once:
        return True
    marker = os.path.join(args.checkpoint_dir or ".", "nan-injected")
    if os.path.exists(marker):
        return False
    os.makedirs(os.path.dirname(marker) or ".", exist_ok=True)
    open(marker, "w").close()
    return True


def print_summary(handle: robust_metrics.hooks.watch.Watch, rank: int) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(handle.store)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    print(f"--- rank {rank}: {len(lines)} series published ---\n" + "\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
