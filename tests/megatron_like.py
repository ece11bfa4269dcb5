"""A Megatron-core-style data-parallel job on the CPU: what megatron-core 0.16.1's
DistributedDataParallel and distributed optimizer do each step, imitated on gloo, where the real
ones cannot run (they allocate their buffers on CUDA: docs/hook.md, Parallelisms).

Each part imitates, in small, the Megatron-core 0.16.1 code it is named after:

- `GradBuffer`: `_ParamAndGradBuffer.__init__` (distributed/param_and_grad_buffer.py): one
  contiguous gradient buffer (`grad_data`) for every parameter, parameters laid out in reverse
  (the order backward produces their gradients), split into buckets, each padded to a multiple of
  the data-parallel size when the distributed optimizer shards it; with the distributed optimizer
  a parameter buffer (`param_data`) too, which the parameters' `.data` become views of.
  Each parameter's `main_grad` is its view of `grad_data`.
- `BucketGroup`: `_ParamAndGradBucketGroup` (same file): `register_grad_ready` issues the
  group's reduction when its last gradient is ready (not in the first step, `is_first_batch`:
  then `finish_grad_sync` issues it), `start_grad_sync` issues each bucket's
  `reduce_scatter_tensor` of `grad_data` into this rank's shard (distributed optimizer) or
  `all_reduce` inside `torch.distributed._coalescing_manager(group, async_ops=True)` and keeps the
  manager as the handle, `finish_grad_sync` waits on it (`cm.wait()`); `start_param_sync` and
  `finish_param_sync` all-gather `param_data` from its shards (`all_gather_into_tensor`), async
  with `overlap_param_gather` (the next group issued once one is waited for), else synchronous;
  `reset` keeps the first step's counts of ready gradients.
- `MegatronLikeDDP`: `DistributedDataParallel` (distributed/distributed_data_parallel.py): the
  gradient-accumulator hooks of `_make_backward_post_hook` (`grad_fn.next_functions` of
  `param.expand_as(param)`: add `param.grad` to `main_grad`, drop `param.grad`, register it
  ready), the forward pre-hooks of `_make_forward_pre_hook` that wait for a module's parameters'
  all-gather (`overlap_param_gather`), `finish_grad_sync`, `zero_grad_buffer`, `start_param_sync`.
- `DistributedOptimizerLike`: `DistributedOptimizer` (optimizer/distrib_optimizer.py) with
  `MixedPrecisionOptimizer.step_with_ready_grads` (optimizer/optimizer.py): fp32 main parameters
  for this rank's shard of each bucket, their gradients the shard of `grad_data`, the inner torch
  optimizer stepped once, the shard copied back into `param_data`
  (`_copy_main_params_to_model_params`), then the parameter all-gather: synchronous here
  without `overlap_param_gather`, else left to the next forward's pre-hooks. `PlainOptimizerLike`:
  `FP32Optimizer` without the distributed optimizer (`param.grad = param.main_grad`).
- `train_step`: megatron/training's `train_step` with `finalize_model_grads`
  (distributed/finalize_model_grads.py), which calls `finish_grad_sync` before the step.

gloo has the collectives Megatron calls (torch 2.13: `reduce_scatter_tensor`, and coalesced
all-reduce, reduce-scatter and all-gather), so no fallback replaces them. What is not imitated:
CUDA streams (tests/gpu_sim.py, mode `megatron`, simulates the job's GPU timing), several
distributed optimizer instances, expert-parallel buffers, fp8 and mixed precision, gradient
accumulation over micro-batches (`no_sync`), pipeline schedules.

As a script, a rank of a job on gloo (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher) with
one `watch()` line; `--record` writes what the job measured itself: per optimizer step its wall
time and the seconds it spent inside the handles' waits and synchronous all-gathers.

    python tests/megatron_like.py --steps 12 --optimizer distributed --slow-rank 1
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _coalescing_manager

__all__ = ["BucketGroup", "DistributedOptimizerLike", "GradBuffer", "MegatronLikeDDP",
           "PlainOptimizerLike", "WaitClock", "train_step"]


class WaitClock:
    """What the job itself measures: seconds inside each wait, attributed to the optimizer step
    they precede (the hook's step ends at the inner optimizer's step)."""

    def __init__(self) -> None:
        self.waits: list[float] = [0.0]
        self.step_ends: list[float] = []

    @contextmanager
    def waiting(self) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.waits[-1] += time.perf_counter() - begin

    def step_end(self) -> None:
        self.step_ends.append(time.perf_counter())
        self.waits.append(0.0)


class BucketGroup:
    """`_ParamAndGradBucketGroup` of one bucket list: issues, and waits for, its collectives."""

    def __init__(self, buckets: list[dict[str, Any]], group: Any, distributed: bool,
                 overlap_param_gather: bool, clock: WaitClock) -> None:
        self.buckets = buckets
        self.params = {p for b in buckets for p in b["params"]}
        self.group, self.distributed = group, distributed
        self.overlap_param_gather = overlap_param_gather
        self.clock = clock
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.is_first_batch = True
        self.ready_counts: dict[nn.Parameter, int] = {}
        self.golden_counts: dict[nn.Parameter, int] | None = None
        self.grad_reduce_handle: Any = None
        self.param_gather_handle: Any = None
        self.param_gather_dispatched = False
        self.next_param_gather: BucketGroup | None = None

    def shard(self, data: torch.Tensor) -> torch.Tensor:
        """`shard_buffer(...)[rank]`: this rank's equal part of a bucket's buffer."""
        size = data.numel() // self.world
        return data[self.rank * size:(self.rank + 1) * size]

    def register_grad_ready(self, param: nn.Parameter) -> None:
        self.ready_counts[param] = self.ready_counts.get(param, 0) + 1
        if not self.is_first_batch and self.ready_counts == self.golden_counts:
            self.start_grad_sync()

    def start_grad_sync(self) -> None:
        assert self.grad_reduce_handle is None, "one reduction in flight per bucket group"
        with _coalescing_manager(self.group, async_ops=True) as cm:
            for bucket in self.buckets:
                grad = bucket["grad_data"]
                if self.distributed:  # each rank keeps the sum of its shard
                    dist.reduce_scatter_tensor(self.shard(grad), grad, group=self.group,
                                               async_op=True)
                else:
                    dist.all_reduce(grad, group=self.group, async_op=True)
        self.grad_reduce_handle = cm

    def finish_grad_sync(self) -> None:
        self.param_gather_dispatched = False
        if self.is_first_batch:
            self.start_grad_sync()
        with self.clock.waiting():
            self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None

    def start_param_sync(self, force_sync: bool = False) -> None:
        async_op = self.overlap_param_gather and not force_sync
        with self.clock.waiting() if not async_op else _nothing(), \
                _coalescing_manager(self.group, async_ops=async_op) as cm:
            for bucket in self.buckets:
                data = bucket["param_data"]
                dist.all_gather_into_tensor(data, self.shard(data), group=self.group,
                                            async_op=async_op)
        self.param_gather_handle = cm if async_op else None
        self.param_gather_dispatched = True

    def finish_param_sync(self) -> None:
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is not None:
            with self.clock.waiting():
                self.param_gather_handle.wait()
            self.param_gather_handle = None
            following = self.next_param_gather
            if following is not None and not following.param_gather_dispatched:
                following.start_param_sync()

    def reset(self) -> None:
        if self.is_first_batch and self.ready_counts:
            self.golden_counts = self.ready_counts
            self.is_first_batch = False
        self.ready_counts = {}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class GradBuffer:
    """`_ParamAndGradBuffer`: contiguous gradient (and parameter) storage split into buckets of
    about `bucket_numel` elements, parameters in reverse order."""

    def __init__(self, params: list[nn.Parameter], bucket_numel: int, world: int,
                 distributed: bool) -> None:
        pad = world if distributed else 1
        layout: list[list[tuple[nn.Parameter, int]]] = [[]]
        offset = start = 0
        for param in reversed(params):
            if layout[-1] and offset - start >= bucket_numel:  # a new bucket at a boundary
                offset = start = -(-offset // pad) * pad
                layout.append([])
            layout[-1].append((param, offset))
            offset += param.numel()
        numel = -(-offset // pad) * pad
        self.grad_data = torch.zeros(numel)
        self.param_data = torch.zeros(numel) if distributed else None
        self.buckets: list[dict[str, Any]] = []
        ends = [entries[0][1] for entries in layout[1:]] + [numel]
        for entries, end in zip(layout, ends, strict=True):
            begin = entries[0][1]
            bucket: dict[str, Any] = {"params": [p for p, _ in entries],
                                      "grad_data": self.grad_data[begin:end]}
            if self.param_data is not None:
                bucket["param_data"] = self.param_data[begin:end]
            self.buckets.append(bucket)
            for param, at in entries:
                param.main_grad = self.grad_data[at:at + param.numel()].view_as(param)
                if self.param_data is not None:  # the parameter lives in the buffer
                    view = self.param_data[at:at + param.numel()].view_as(param)
                    view.copy_(param.data)
                    param.data = view


class MegatronLikeDDP(nn.Module):
    """`DistributedDataParallel` of Megatron-core: gradient buffer, bucket groups, hooks."""

    def __init__(self, module: nn.Module, *, distributed: bool, overlap_param_gather: bool = False,
                 bucket_numel: int = 2048, group: Any = None,
                 clock: WaitClock | None = None) -> None:
        super().__init__()
        self.module = module
        self.distributed = distributed
        self.overlap_param_gather = distributed and overlap_param_gather
        self.clock = clock or WaitClock()
        params = [p for p in module.parameters() if p.requires_grad]
        self.buffer = GradBuffer(params, bucket_numel, dist.get_world_size(group), distributed)
        self.bucket_groups = [BucketGroup([b], group, distributed, self.overlap_param_gather,
                                          self.clock) for b in self.buffer.buckets]
        forward_order = self.bucket_groups[::-1]  # buckets hold parameters in reverse
        for group_, following in zip(forward_order, [*forward_order[1:], None], strict=True):
            group_.next_param_gather = following
        self.param_to_bucket_group = {p: g for g in self.bucket_groups for p in g.params}
        self.grad_accs = []
        for param in params:
            grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._make_backward_post_hook(param))
            self.grad_accs.append(grad_acc)  # kept alive, as Megatron keeps them
        if self.overlap_param_gather:
            for sub in module.modules():
                sub.register_forward_pre_hook(self._make_forward_pre_hook())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _make_backward_post_hook(self, param: nn.Parameter) -> Callable[..., None]:
        def hook(*unused: Any) -> None:
            if param.grad is not None:
                param.main_grad.add_(param.grad.data)
            param.grad = None
            self.param_to_bucket_group[param].register_grad_ready(param)

        return hook

    def _make_forward_pre_hook(self) -> Callable[..., None]:
        def hook(module: nn.Module, *unused: Any) -> None:
            for param in module.parameters(recurse=False):
                if param in self.param_to_bucket_group:
                    self.param_to_bucket_group[param].finish_param_sync()

        return hook

    def finish_grad_sync(self) -> None:
        for group in self.bucket_groups:
            group.finish_grad_sync()

    def start_param_sync(self, force_sync: bool = False) -> None:
        for group in self.bucket_groups:
            group.start_param_sync(force_sync=force_sync)

    def zero_grad_buffer(self) -> None:
        self.buffer.grad_data.zero_()
        for group in self.bucket_groups:
            group.reset()


class DistributedOptimizerLike:
    """`DistributedOptimizer`: the inner torch optimizer steps this rank's fp32 shard."""

    def __init__(self, model: MegatronLikeDDP, lr: float = 0.01) -> None:
        assert model.distributed
        self.model = model
        self.shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for group in model.bucket_groups:
            for bucket in group.buckets:
                model_shard = group.shard(bucket["param_data"])
                main = nn.Parameter(model_shard.detach().clone().float())
                self.shards.append((main, model_shard, group.shard(bucket["grad_data"])))
        self.optimizer = torch.optim.SGD([m for m, _, _ in self.shards], lr=lr)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        for main, _, _ in self.shards:
            main.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for main, _, grad_shard in self.shards:  # the reduced shard of the gradient buffer
            main.grad = grad_shard.float()
        self.optimizer.step()
        for main, model_shard, _ in self.shards:  # _copy_main_params_to_model_params
            model_shard.copy_(main)
        if not self.model.overlap_param_gather:
            self.model.start_param_sync()  # synchronous all-gather of the parameters


class PlainOptimizerLike:
    """`FP32Optimizer`: every rank steps every parameter with the all-reduced `main_grad`."""

    def __init__(self, model: MegatronLikeDDP, lr: float = 0.01) -> None:
        self.model = model
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=lr)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for param in self.params:
            param.grad = param.main_grad
        self.optimizer.step()


def train_step(model: MegatronLikeDDP, optimizer: DistributedOptimizerLike | PlainOptimizerLike,
               batch: torch.Tensor) -> torch.Tensor:
    """megatron/training `train_step`: zero the buffer, forward and backward, then
    `finalize_model_grads` (`finish_grad_sync`) and the optimizer's step."""
    optimizer.zero_grad()
    loss = model(batch).pow(2).mean()
    loss.backward()
    model.finish_grad_sync()  # finalize_model_grads
    optimizer.step()
    return loss.detach()


class Paced(nn.Module):
    """Four layers whose forward takes `seconds` of this rank's compute (a known sleep)."""

    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.layers(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--optimizer", choices=["plain", "distributed"], default="distributed")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--compute", type=float, default=0.1, help="forward seconds of every rank")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.3,
                   help="the slow rank's forward takes this many times --compute")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--record", type=Path, help="folder for rank<N>.json of the job's own times")
    p.add_argument("--megatron", action="store_true",
                   help="the real megatron-core on CUDA and NCCL instead of the imitation")
    return p.parse_args(argv)


def run_megatron(args: argparse.Namespace, clock: WaitClock) -> None:
    """The same job with the real megatron-core on CUDA and NCCL, one GPU per rank."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    import robust_metrics

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel()
    rank = dist.get_rank()
    torch.manual_seed(0)
    seconds = args.compute * (args.slow_factor if rank == args.slow_rank else 1.0)
    distributed = args.optimizer == "distributed"
    config = TransformerConfig(num_layers=1, hidden_size=args.width, num_attention_heads=1)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=distributed,
        overlap_param_gather=distributed and args.overlap_param_gather,
        bucket_size=2 * args.width * (args.width + 1))
    model = DistributedDataParallel(config=config, ddp_config=ddp_config,
                                    module=Paced(args.width, seconds).cuda())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.01, use_distributed_optimizer=distributed,
                        overlap_param_gather=distributed and args.overlap_param_gather),
        [model])
    optimizer.optimizer.register_step_post_hook(lambda *_: clock.step_end())
    generator = torch.Generator(device="cuda").manual_seed(rank)
    with robust_metrics.watch(model, optimizer):  # the one line
        for _ in range(args.steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            batch = torch.randn(8, args.width, device="cuda", generator=generator)
            model(batch).pow(2).mean().backward()
            model.finish_grad_sync()  # finalize_model_grads
            optimizer.step()
        torch.cuda.synchronize()
    parallel_state.destroy_model_parallel()


def main(argv: list[str] | None = None) -> None:
    import robust_metrics

    args = parse_args(argv)
    if args.megatron:
        clock = WaitClock()
        run_megatron(args, clock)
        if args.record is not None:
            (args.record / f"rank{dist.get_rank()}.json").write_text(
                json.dumps({"step_ends": clock.step_ends}))
        dist.barrier()
        dist.destroy_process_group()
        return
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial parameters on every rank
    seconds = args.compute * (args.slow_factor if rank == args.slow_rank else 1.0)
    clock = WaitClock()
    distributed = args.optimizer == "distributed"
    # 4 x (64 x 64 + 64) parameters, about 2 layers a bucket: 2 bucket groups
    model = MegatronLikeDDP(Paced(args.width, seconds), distributed=distributed,
                            overlap_param_gather=args.overlap_param_gather,
                            bucket_numel=2 * args.width * (args.width + 1), clock=clock)
    optimizer: DistributedOptimizerLike | PlainOptimizerLike = (
        DistributedOptimizerLike(model) if distributed else PlainOptimizerLike(model))
    optimizer.optimizer.register_step_post_hook(lambda *_: clock.step_end())
    generator = torch.Generator().manual_seed(rank)
    dist.barrier()  # ranks start apart: the first step should not wait for a peer's start-up
    with robust_metrics.watch(model, optimizer):  # the one line
        start = time.perf_counter()  # the hook's first step starts at the first forward
        for _ in range(args.steps):
            train_step(model, optimizer, torch.randn(8, args.width, generator=generator))
    if args.record is not None:
        record = {"start": start, "step_ends": clock.step_ends,
                  "waits": clock.waits[:len(clock.step_ends)],
                  "bucket_groups": len(model.bucket_groups)}
        (args.record / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from robust_metrics.workloads.ending import exit_process

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_process()  # see robust_metrics.workloads.ending
