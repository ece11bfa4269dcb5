"""A DDP training job (an MLP with Adam on gloo) with one `watch()` line and injectable faults.

Used by the end-to-end alert tests (tests/integration/test_alerts_sidecar_e2e.py) and
bench/detection_matrix.py. Every rank runs it; a fault option names the rank it applies to (-1:
none). Steps take `--compute` seconds of simulated
compute (a sleep in forward, split with backward) plus `--step-sleep`, so slowdown factors are
exact on a shared CPU.

Faults: checkpoint and eval phases, a delay before the first step, a stop (SIGSTOP) inside a
collective, slow forward or backward, NaN loss, NaN gradients, loss and gradient-norm spikes, a
data-loading stall on every rank, a GC storm, CPU work for a contention test, a normal end
followed by a slow shutdown. A rank that injects a fault prints `FAULT <unix time>` first, so a
benchmark can time detection from the moment of the fault.

`--duration` ends the job after that many seconds with `--checkpoints` checkpoint and `--evals`
eval phases spread over it; rank 0 decides from its clock and tells the others every 10 steps
through an all-reduce, so every rank takes the same step into a phase or out of the loop.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import robust_metrics
from robust_metrics.workloads.ending import exit_process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    a = p.add_argument
    a("--steps", type=int, default=1_000_000)
    a("--compute", type=float, default=0.04, help="simulated compute seconds per step")
    a("--step-sleep", type=float, default=0.0, help="extra seconds per step on every rank")
    a("--checkpoint-every", type=int, default=0)
    a("--checkpoint-seconds", type=float, default=3.0)
    a("--eval-every", type=int, default=0)
    a("--eval-seconds", type=float, default=3.0)
    a("--first-step-delay-rank", type=int, default=-1)
    a("--first-step-delay", type=float, default=12.0)
    a("--stop-rank", type=int, default=-1, help="SIGSTOP itself inside the all-reduce")
    a("--stop-step", type=int, default=100)
    a("--slow-rank", type=int, default=-1)
    a("--slow-factor", type=float, default=1.3)
    a("--slow-where", choices=("forward", "backward"), default="forward")
    a("--nan-loss-rank", type=int, default=-1)
    a("--nan-grad-rank", type=int, default=-1)
    a("--nan-step", type=int, default=150)
    a("--loss-spike-step", type=int, default=-1)
    a("--grad-spike-step", type=int, default=-1)
    a("--spike-steps", type=int, default=5)
    a("--spike-factor", type=float, default=30.0)
    a("--stall-step", type=int, default=-1, help="every rank waits for data at this step")
    a("--stall-seconds", type=float, default=6.0)
    a("--gc-rank", type=int, default=-1, help="this rank runs a GC storm every step")
    a("--shutdown-seconds", type=float, default=0.0, help="sleep after close() (normal end)")
    a("--slow-step", type=int, default=0, help="the slow or GC-storm rank starts at this step")
    a("--work", type=int, default=0, help="matrix products of real CPU work per step")
    a("--duration", type=float, default=0.0, help="seconds, then a normal end (0: use --steps)")
    a("--checkpoints", type=int, default=0, help="checkpoint phases over --duration")
    a("--evals", type=int, default=0, help="eval phases over --duration")
    return p.parse_args(argv)


class MLP(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.forward_sleep = 0.0
        self.backward_sleep = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_sleep)
        out = self.net(x)
        if self.backward_sleep and out.requires_grad:
            out.register_hook(self._sleep_in_backward)
        return out

    def _sleep_in_backward(self, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(self.backward_sleep)
        return grad


def fault(what: str) -> None:
    print(f"FAULT {time.time():.6f} {what}", flush=True)


def stop_self_later(seconds: float) -> None:
    def stop() -> None:
        fault("sigstop")
        os.kill(os.getpid(), signal.SIGSTOP)
    threading.Timer(seconds, stop).start()


class Schedule:
    """Rank 0's plan for --duration: 1 = checkpoint, 2 = eval, 3 = stop, agreed every 10 steps."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.start = time.time()
        self.duration = args.duration
        self.rank = rank
        plan = [((i + 0.5) * args.duration / max(args.checkpoints, 1), 1)
                for i in range(args.checkpoints)]
        plan += [((i + 0.75) * args.duration / max(args.evals, 1), 2) for i in range(args.evals)]
        self.plan = sorted(plan)

    def next_action(self) -> int:
        action = 0
        if self.rank == 0:
            elapsed = time.time() - self.start
            if elapsed >= self.duration:
                action = 3
            elif self.plan and elapsed >= self.plan[0][0]:
                action = self.plan.pop(0)[1]
        flag = torch.tensor([action])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def gc_storm() -> None:
    garbage = [[{"i": i}] for i in range(20_000)]
    for _ in range(3):
        gc.collect()
    del garbage


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    handle = robust_metrics.watch(ddp, optimizer)
    generator = torch.Generator().manual_seed(rank)
    half = args.compute / 2
    model.forward_sleep = model.backward_sleep = half
    schedule = Schedule(args, rank) if args.duration else None
    work = torch.randn(96, 96, generator=torch.Generator().manual_seed(1))
    grad_scale = {"factor": 1.0}
    model.net[0].weight.register_hook(lambda g: g * grad_scale["factor"])
    with handle:
        for step in range(args.steps):
            if step == 0 and rank == args.first_step_delay_rank:
                fault("late first step")
                time.sleep(args.first_step_delay)
            if step == args.stall_step:
                fault("data stall")
                time.sleep(args.stall_seconds)
            if step == args.stop_step and args.stop_rank >= 0:
                if rank == args.stop_rank:
                    stop_self_later(0.5)  # while it waits in the gradient all-reduce
                else:
                    time.sleep(1.0)
            if step == args.slow_step and rank == args.slow_rank:
                fault(f"slow {args.slow_where} x{args.slow_factor}")
                extra = args.compute * (args.slow_factor - 1)
                if args.slow_where == "forward":
                    model.forward_sleep += extra
                else:
                    model.backward_sleep += extra
            if rank == args.gc_rank and step >= args.slow_step:
                if step == args.slow_step:
                    fault("gc storm")
                gc_storm()
            for _ in range(args.work):
                work = torch.tanh(work @ work)
            x = torch.randn(16, 32, generator=generator)
            loss = ddp(x).pow(2).mean() + 1.0
            if 0 <= args.loss_spike_step <= step < args.loss_spike_step + args.spike_steps:
                if step == args.loss_spike_step:
                    fault("loss spike")
                loss = loss * args.spike_factor
            if step == args.nan_step and rank == args.nan_loss_rank:
                fault("nan loss")
                loss = loss * float("nan")
            spike = 0 <= args.grad_spike_step <= step < args.grad_spike_step + args.spike_steps
            if step == args.grad_spike_step:
                fault("grad-norm spike")
            nan_grad = step == args.nan_step and rank == args.nan_grad_rank
            if nan_grad:
                fault("nan gradients")
            grad_scale["factor"] = float("nan") if nan_grad else (args.spike_factor if spike else 1.0)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), float("inf"))
            if not torch.isfinite(norm):  # drop the update, as AMP's GradScaler skips it
                for p in ddp.parameters():
                    p.grad.zero_()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            action = schedule.next_action() if schedule and step % 10 == 9 else 0
            if action == 3:
                break
            if action == 1 or (args.checkpoint_every and step and step % args.checkpoint_every == 0):
                with handle.phase("checkpoint"):
                    if rank == 0:
                        time.sleep(args.checkpoint_seconds)  # rank 0 writes, the others wait
                    dist.barrier()
            if action == 2 or (
                    args.eval_every and step and step % args.eval_every == args.eval_every // 2):
                with handle.phase("eval"):
                    time.sleep(args.eval_seconds)
                    dist.barrier()
    time.sleep(args.shutdown_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
