"""A training job on the stacks large models use, with one `watch()` line and a slow rank.

Every rank runs it (`robust_metrics.processes.RankJob(..., script=<this file>)`, or
`torchrun --nproc-per-node 2 -m robust_metrics.workloads.parallel_job --stack pp`). `--stack`
picks the parallelism, all real PyTorch on gloo: `ddp`, `fsdp2` (`fully_shard` per block and the root), `tp`
(`parallelize_module` with Colwise/RowwiseParallel, `--sequence-parallel` adds SequenceParallel
norms), `pp` (two or more `PipelineStage`s under `--schedule` gpipe, 1f1b or interleaved),
`fsdp2_tp` (a 2-D mesh) and `pp_fsdp2` (stages sharded over a DP dimension). The model is blocks of
real layers; each block also spends `--compute` seconds per step (split over its forward and
backward, and over micro-batches) in a sleep, so that a slowdown factor is exact on a shared CPU.
`--slow-factor` makes `--slow-rank` that much slower in forward, backward or the optimizer.
`--amp-skip-every N` runs fp16-style loss scaling with `torch.amp.GradScaler` and injects an
overflow every N steps (the scaler skips that step). `--heavy-last-stage K`: the last pipeline stage
gets K times the blocks (real work, no sleep). `--stop-rank` SIGSTOPs itself at `--stop-step`.
`--device cuda` runs it on GPUs with NCCL (one per `LOCAL_RANK`): the sleeps become GPU kernels
of the same length (`torch.cuda._sleep`, calibrated), device time the host does not wait for, and
each step ends with a synchronisation, as a job that reads its loss every step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import robust_metrics
from robust_metrics.workloads.ending import exit_process

STACKS = ("ddp", "fsdp2", "tp", "pp", "fsdp2_tp", "pp_fsdp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    a = p.add_argument
    a("--stack", choices=STACKS, default="fsdp2")
    a("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="gpipe")
    a("--steps", type=int, default=30)
    a("--duration", type=float, default=0.0, help="seconds, then a normal end (0: use --steps)")
    a("--blocks", type=int, default=4)
    a("--width", type=int, default=32)
    a("--microbatches", type=int, default=4)
    a("--compute", type=float, default=0.04, help="sleep seconds per step and rank")
    a("--slow-rank", type=int, default=-1)
    a("--slow-factor", type=float, default=1.3)
    a("--slow-where", choices=("forward", "backward", "optimizer"), default="forward")
    a("--reshard-after-forward", choices=("true", "false"), default="true")
    a("--sequence-parallel", action="store_true")
    a("--amp-skip-every", type=int, default=0)
    a("--compile", action="store_true", help="ddp: DDP around a torch.compile'd model")
    a("--heavy-last-stage", type=int, default=1)
    a("--stop-rank", type=int, default=-1)
    a("--stop-step", type=int, default=20)
    a("--tp", type=int, default=2, help="tensor-parallel degree of fsdp2_tp")
    a("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, a GPU per LOCAL_RANK")
    a("--trace-dir", default="", help="record what-if op traces here (robust-metrics whatif)")
    a("--trace-every", type=int, default=5)
    a("--trace-steps", type=int, default=1)
    return p.parse_args(argv)


class Sleep(torch.autograd.Function):
    """Spends `forward` seconds in forward and `backward` seconds in backward: simulated compute."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, pace: Pace) -> torch.Tensor:  # type: ignore[override]
        ctx.pace = pace  # type: ignore[attr-defined]
        spend(pace.forward, x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        spend(ctx.pace.backward, grad)  # type: ignore[attr-defined]
        return grad, None


_gpu_cycles_per_second = 0.0


def spend(seconds: float, like: torch.Tensor) -> None:
    """Simulated compute: a host sleep on the CPU; on a GPU a kernel that spins as long."""
    if like.is_cuda and _gpu_cycles_per_second:
        torch.cuda._sleep(int(seconds * _gpu_cycles_per_second))
    else:
        time.sleep(seconds)


def calibrate_gpu_sleep() -> None:
    """Cycles per second of `torch.cuda._sleep` on this rank's GPU (before the watch)."""
    global _gpu_cycles_per_second
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    _gpu_cycles_per_second = cycles / (start.elapsed_time(end) / 1000.0)


class Pace:
    """Seconds one block sleeps per call, shared by every block of a rank."""

    def __init__(self, forward: float, backward: float) -> None:
        self.forward, self.backward = forward, backward


class Block(nn.Module):
    def __init__(self, width: int, pace: Pace) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.pace = pace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.down(torch.relu(self.up(self.norm(x))))
        return Sleep.apply(out, self.pace)  # on the output: its backward runs in every block


class Model(nn.Module):
    def __init__(self, width: int, blocks: int, pace: Pace, head: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, pace) for _ in range(blocks))
        self.head = nn.Linear(width, 1) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def stop_self_later(seconds: float) -> None:
    def stop() -> None:
        print(f"FAULT {time.time():.6f} sigstop", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    threading.Timer(seconds, stop).start()


class Job:
    """The model, optimizer and one step for the chosen stack."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if args.device == "cuda" else torch.device("cpu")
        per_block = args.compute / 2 / args.blocks / self._calls()
        self.pace = Pace(per_block, per_block)
        self.optimizer_sleep = 0.0
        self.schedule = None
        self.scaler = None
        torch.manual_seed(0)
        with self.device if self.device.type == "cuda" else contextlib.nullcontext():
            getattr(self, f"_build_{args.stack}")()  # modules made on the job's device
        if args.amp_skip_every:
            self.scaler = torch.amp.GradScaler(self.device.type, init_scale=2.0 ** 8,
                                               growth_interval=1000)

    # -- stacks ----------------------------------------------------------------------------
    def _build_ddp(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = Model(self.args.width, self.args.blocks, self.pace)
        if self.args.compile:  # DDP around a compiled model
            inner.compile()
        self.model = DDP(inner)
        self.watched = self.model

    def _build_fsdp2(self, mesh: object = None) -> None:

        model = Model(self.args.width, self.args.blocks, self.pace)
        self._shard(model, mesh)
        self.model = self.watched = model

    def _shard(self, model: nn.Module, mesh: object) -> None:
        from torch.distributed.fsdp import fully_shard

        reshard = self.args.reshard_after_forward == "true"
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    def _build_tp(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("tp",))
        model = Model(self.args.width, self.args.blocks, self.pace)
        self._parallelize(model, mesh)
        self.model = self.watched = model

    def _parallelize(self, model: nn.Module, mesh: object) -> None:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        sp = self.args.sequence_parallel  # activations [batch, sequence, width], sequence sharded
        for layer in model.layers:
            plan: dict[str, object] = {
                "up": ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel(),
                "down": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            }
            if sp:
                plan["norm"] = SequenceParallel()
            parallelize_module(layer, mesh, plan)  # type: ignore[arg-type]

    def _build_fsdp2_tp(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        tp = self.args.tp
        mesh = init_device_mesh(self.device.type, (self.world // tp, tp), mesh_dim_names=("dp", "tp"))
        model = Model(self.args.width, self.args.blocks, self.pace)
        self._parallelize(model, mesh["tp"])
        self._shard(model, mesh["dp"])
        self.model = self.watched = model

    def _build_pp(self, dp: int = 1) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        args = self.args
        pp = self.world // dp
        mesh = init_device_mesh(self.device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
        pp_rank = mesh["pp"].get_local_rank()
        per_rank = 2 if args.schedule == "interleaved" else 1
        stage_ids = [pp_rank + i * pp for i in range(per_rank)]
        total = pp * per_rank
        stages, modules = [], []
        for sid in stage_ids:
            last = sid == total - 1
            blocks = args.blocks * (args.heavy_last_stage if last else 1)
            module = Model(args.width, blocks, self.pace, head=last)
            if dp > 1:
                self._shard(module, mesh["dp"])
            modules.append(module)
            stages.append(PipelineStage(module, sid, total, self.device,
                                        group=mesh["pp"].get_group()))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                "interleaved": ScheduleInterleaved1F1B}[args.schedule]
        loss = lambda out, target: (out - target).pow(2).mean()  # noqa: E731
        self.schedule = kind(stages if per_rank > 1 else stages[0], args.microbatches,
                             loss_fn=loss)
        self.stages, self.model = stages, nn.ModuleList(modules)
        self.watched = stages if per_rank > 1 else stages[0]
        self.first = 0 in stage_ids
        self.last = total - 1 in stage_ids

    def _build_pp_fsdp2(self) -> None:
        self._build_pp(dp=2)

    # -- slowing and faults ----------------------------------------------------------------
    def slow_down(self) -> None:
        args, extra = self.args, self.args.slow_factor - 1
        per_block = extra * args.compute / args.blocks / self._calls()  # the step's compute x
        if args.slow_where == "forward":
            self.pace.forward += per_block
        elif args.slow_where == "backward":
            self.pace.backward += per_block
        else:
            self.optimizer_sleep = extra * args.compute
        print(f"FAULT {time.time():.6f} slow {args.slow_where} x{args.slow_factor}", flush=True)

    def _calls(self) -> int:
        """Calls of each block per step: micro-batches, times a rank's stages (interleaved)."""
        if self.args.stack not in ("pp", "pp_fsdp2"):
            return 1
        return self.args.microbatches * (2 if self.args.schedule == "interleaved" else 1)

    # -- one step --------------------------------------------------------------------------
    def step(self, step: int, optimizer: torch.optim.Optimizer,
             generator: torch.Generator) -> None:
        args = self.args
        x = torch.randn(8 * args.microbatches, args.width, generator=generator)
        if args.sequence_parallel:  # this rank's part of a sequence of 2 x world positions
            x = torch.randn(4, 2 * self.world, args.width, generator=generator)
            x = x.chunk(self.world, dim=1)[self.rank].contiguous()
        target = torch.zeros(*x.shape[:-1], 1)
        x, target = x.to(self.device), target.to(self.device)
        if self.schedule is not None:
            if self.first:
                self.schedule.step(x, target=target if self.last else None)
            elif self.last:
                self.schedule.step(target=target)
            else:
                self.schedule.step()
        else:
            loss = (self.model(x) - target).pow(2).mean()
            overflow = bool(args.amp_skip_every) and step % args.amp_skip_every == \
                args.amp_skip_every - 1
            if self.scaler is not None:
                scaled = self.scaler.scale(loss)
                if overflow:
                    scaled = scaled * float("inf")
                scaled.backward()
                self.scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9)
            else:
                loss.backward()
        if self.optimizer_sleep:
            spend(self.optimizer_sleep, x)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        calibrate_gpu_sleep()
    else:
        dist.init_process_group("gloo")
    job = Job(args)
    optimizer = torch.optim.AdamW(job.model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1234)  # the same batch on every rank
    if args.compile:  # compile before the watch, as a job warms up before it trains
        job.step(-1, optimizer, generator)
    if job.device.type == "cuda":  # lazy inits and NCCL communicators before the watch
        job.step(-1, optimizer, generator)
        torch.cuda.synchronize()
    tracing = {"trace_dir": args.trace_dir, "trace_every": args.trace_every,
               "trace_steps": args.trace_steps} if args.trace_dir else {}
    handle = robust_metrics.watch(job.watched, optimizer, **tracing)
    if job.rank == args.slow_rank:
        job.slow_down()
    started = time.time()
    with handle:
        for step in range(args.steps if not args.duration else 1 << 30):
            if step == args.stop_step and job.rank == args.stop_rank:
                stop_self_later(0.02)
            job.step(step, optimizer, generator)
            if job.device.type == "cuda":
                torch.cuda.synchronize()  # the job's own, as reading the loss: the hook adds none
            if args.duration and _agree_to_stop(time.time() - started >= args.duration,
                                                job.device):
                break
    dist.barrier()
    dist.destroy_process_group()


def _agree_to_stop(mine: bool, device: torch.device) -> bool:
    flag = torch.tensor([int(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
