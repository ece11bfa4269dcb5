"""A training job under a framework's own wrappers, with one `watch()` line and a slow rank.

Every rank runs it (`robust_metrics.processes.RankJob(..., script=<this file>)`). `--framework`
picks the stack, all real on the CPU with gloo:

- `accelerate-ddp`, `accelerate-fsdp` (Hugging Face Accelerate: `accelerator.prepare()` under its
  DDP or FSDP plugin (FSDP2), `accelerator.backward`, `accelerator.clip_grad_norm_`,
  `--grad-accum` micro-batches per optimizer step through `accelerator.accumulate`);
- `hf-trainer` (the Hugging Face `Trainer` with `RobustMetricsCallback`, under `--fsdp`);
- `deepspeed` (`deepspeed.initialize` at ZeRO `--zero 0|1|2|3`, `engine.backward`, `engine.step`,
  two parameter groups as LLM recipes use, with and without weight decay; needs
  `DS_ACCELERATOR=cpu` on a machine without GPUs).

The model is parallel_job.py's blocks of real layers that also spend `--compute` seconds per step
in a sleep, so a slowdown factor is exact on a shared CPU; `--slow-rank` spends `--slow-factor`
times as long in forward. With `--record DIR` each rank writes `rank<r>.json`: what the framework
itself computed at each optimizer step (the loss of the step, the gradient norm it clipped by),
so a test can hold the hook's series against the framework's own figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import robust_metrics
from robust_metrics.workloads.ending import exit_process
from robust_metrics.workloads.parallel_job import Model, Pace

FRAMEWORKS = ("accelerate-ddp", "accelerate-fsdp", "hf-trainer", "deepspeed")
BATCH = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--framework", choices=FRAMEWORKS, required=True)
    a("--steps", type=int, default=16, help="optimizer steps")
    a("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    a("--zero", type=int, choices=(0, 1, 2, 3), default=1, help="deepspeed: ZeRO stage")
    a("--trainer-fsdp", action="store_true", help="hf-trainer: FSDP2 instead of DDP")
    a("--blocks", type=int, default=4)
    a("--width", type=int, default=32)
    a("--compute", type=float, default=0.04, help="sleep seconds per micro-batch and rank")
    a("--slow-rank", type=int, default=-1)
    a("--slow-factor", type=float, default=1.3)
    a("--record", default="", help="folder for each rank's record of the framework's figures")
    return p.parse_args(argv)


class Recorder:
    """The framework's own figures per optimizer step, written as JSON at the end."""

    def __init__(self, folder: str, rank: int) -> None:
        self.path = Path(folder) / f"rank{rank}.json" if folder else None
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self._micro: list[float] = []

    def micro_loss(self, loss: torch.Tensor) -> None:
        self._micro.append(float(loss.detach()))

    def step(self, grad_norm: Any) -> None:
        """An optimizer step: the mean loss of its micro-batches and the norm clipped by."""
        if self._micro:
            self.losses.append(sum(self._micro) / len(self._micro))
        self._micro = []
        if grad_norm is not None:
            self.grad_norms.append(float(grad_norm))

    def write(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps({"losses": self.losses,
                                             "grad_norms": self.grad_norms}))


def model_and_pace(args: argparse.Namespace, rank: int) -> tuple[Model, Pace]:
    """The same initial model on every rank; the slow rank's forward sleeps longer."""
    per_block = args.compute / 2 / args.blocks
    pace = Pace(per_block, per_block)
    if rank == args.slow_rank:
        pace.forward += (args.slow_factor - 1) * args.compute / args.blocks
        print(f"FAULT {time.time():.6f} slow forward x{args.slow_factor}", flush=True)
    torch.manual_seed(0)
    return Model(args.width, args.blocks, pace), pace


def batches(rank: int) -> torch.Generator:
    """Each rank its own data, as a data-parallel rank reads its own shard."""
    return torch.Generator().manual_seed(1234 + rank)


def regression_loss(model: Any, generator: torch.Generator, width: int) -> torch.Tensor:
    x = torch.randn(BATCH, width, generator=generator)
    return (model(x) - 1.0).pow(2).mean()


# -- Accelerate ---------------------------------------------------------------------------------
def run_accelerate(args: argparse.Namespace) -> None:
    from accelerate import Accelerator

    plugin = None
    if args.framework == "accelerate-fsdp":
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, cpu_ram_efficient_loading=False,
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin,
                              gradient_accumulation_steps=args.grad_accum)
    if plugin is not None:
        force_fsdp(accelerator, plugin)
    rank = accelerator.process_index
    model, _ = model_and_pace(args, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    print(f"prepared {type(model).__name__} {type(optimizer).__name__} "
          f"{accelerator.distributed_type}", flush=True)
    record, generator = Recorder(args.record, rank), batches(rank)
    with robust_metrics.watch(model, optimizer):  # the one line
        for _ in range(args.steps * args.grad_accum):
            with accelerator.accumulate(model):
                loss = regression_loss(model, generator, args.width)
                record.micro_loss(loss)
                accelerator.backward(loss)
                norm = None
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9)
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    record.step(norm)
    record.write()
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


def force_fsdp(accelerator: Any, plugin: Any) -> None:
    """Accelerate selects its FSDP plugin only on accelerators (GPUs, NPUs, ...): on the CPU its
    state stays MULTI_CPU and `prepare()` wraps in DDP. Set the state `prepare()` reads, as it is
    on a GPU, so the CPU job runs Accelerate's own FSDP path (`fsdp2_prepare_model`, its
    `clip_grad_norm_`)."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin


# -- Hugging Face Trainer -----------------------------------------------------------------------
def run_trainer(args: argparse.Namespace) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from robust_metrics.integrations.huggingface import RobustMetricsCallback

    rank = int(os.environ["RANK"])
    inner, _ = model_and_pace(args, rank)
    width = args.width

    class Regression(torch.nn.Module):
        """The Trainer's contract: keyword inputs in, a dict with the loss out."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.inner(x) - labels).pow(2).mean()}

    class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1234)
            self.x = torch.randn(BATCH * 2 * args.steps * args.grad_accum, width, generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": torch.ones(1)}

    record = Recorder(args.record, rank)

    class Figures(TrainerCallback):  # type: ignore[misc]
        """The Trainer's own loss and gradient norm of each step, from its logs."""

        def on_log(self, a: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                record.losses.append(float(logs["loss"]))
                if "grad_norm" in logs:
                    record.grad_norms.append(float(logs["grad_norm"]))

    fsdp = {"fsdp": True, "fsdp_config": {
        "version": 2, "reshard_after_forward": True, "cpu_ram_efficient_loading": False,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": ["Block"]},
    } if args.trainer_fsdp else {}
    training = TrainingArguments(
        output_dir=str(Path(args.record or ".") / f"trainer{rank}"), use_cpu=True,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to=[],
        max_grad_norm=1e9, dataloader_num_workers=0, disable_tqdm=True,
        ddp_backend="gloo", **fsdp)
    trainer = Trainer(model=Regression(), args=training, train_dataset=Data(),
                      callbacks=[RobustMetricsCallback(), Figures()])
    if args.trainer_fsdp:
        from accelerate import FullyShardedDataParallelPlugin

        force_fsdp(trainer.accelerator, FullyShardedDataParallelPlugin(**training.fsdp_plugin_args))
        trainer.is_fsdp_enabled = True
    trainer.train()
    record.write()
    dist.barrier()
    dist.destroy_process_group()


# -- DeepSpeed ----------------------------------------------------------------------------------
def run_deepspeed(args: argparse.Namespace) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model, _ = model_and_pace(args, rank)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1e9,  # DeepSpeed computes the global norm to clip by
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # ZeRO-3 steps its optimizer per sub-group of this many elements: several here, as in a
        # large model under the default (1e9)
        "zero_optimization": {"stage": args.zero, "sub_group_size": 4096},
        "steps_per_print": 1 << 30,
    }
    decay = [p for p in model.parameters() if p.dim() > 1]
    groups = [{"params": decay, "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                                   config=config)
    print(f"initialized {type(engine).__name__} {type(optimizer).__name__} ZeRO {args.zero}",
          flush=True)
    record, generator = Recorder(args.record, rank), batches(rank)
    with robust_metrics.watch(engine, optimizer):  # the one line
        for _ in range(args.steps * args.grad_accum):
            loss = regression_loss(engine, generator, args.width)
            record.micro_loss(loss)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                record.step(engine.get_global_grad_norm())
    record.write()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.framework.startswith("accelerate"):
        run_accelerate(args)
    elif args.framework == "hf-trainer":
        run_trainer(args)
    else:
        run_deepspeed(args)


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
