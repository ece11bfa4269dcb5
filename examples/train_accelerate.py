"""Hugging Face Accelerate with the one robust-metrics line.

    torchrun --nproc-per-node 2 examples/train_accelerate.py                  # DDP, CPU and gloo
    accelerate launch --use_fsdp --fsdp_version 2 examples/train_accelerate.py  # FSDP2, on GPUs

Watch the model and optimizer that `accelerator.prepare()` returned: the hook finds the DDP or
FSDP2 module inside, steps once per optimizer step (not per micro-batch under
`accelerator.accumulate`), publishes the loss given to `accelerator.backward` (before Accelerate
divides it by the accumulation steps) and the whole model's norm `accelerator.clip_grad_norm_`
clipped by. Accelerate uses its FSDP plugin on accelerators only: on the CPU it trains with DDP.
The Trainer: `Trainer(..., callbacks=[RobustMetricsCallback()])`
(robust_metrics.integrations.huggingface).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

import robust_metrics
from robust_metrics.workloads.ending import exit_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2)
    args = parser.parse_args()
    # Without GPUs Accelerate trains across CPU ranks (gloo) only when told `cpu=True`.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              gradient_accumulation_steps=args.grad_accum)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    with robust_metrics.watch(model, optimizer):  # the one line
        for _ in range(args.steps * args.grad_accum):
            with accelerator.accumulate(model):
                x = torch.randn(32, 64, device=accelerator.device)
                loss = model(x).pow(2).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    accelerator.end_training()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
