"""DeepSpeed (ZeRO 1, 2 or 3) with the one robust-metrics line.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/train_deepspeed.py --zero 3  # CPU, gloo
    deepspeed --num_gpus 8 examples/train_deepspeed.py --zero 3 --backend nccl           # GPUs

`pip install -e '.[deepspeed]'`. Watch the engine and the optimizer `deepspeed.initialize`
returned: the hook counts one step per optimizer step of `engine.step()` (DeepSpeed's optimizer
steps its torch optimizer once per parameter group or ZeRO-3 sub-group), publishes the loss given
to `engine.backward` and the global gradient norm DeepSpeed computed over every rank's partition,
and times DeepSpeed's all-reduces, reduce-scatters and all-gathers as blocked time. On the CPU,
DeepSpeed compiles a small communication op with g++ the first time.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
from torch import nn

import robust_metrics
from robust_metrics.workloads.ending import exit_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=2)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    config = {"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": args.zero}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config)

    with robust_metrics.watch(engine, optimizer):  # the one line
        for _ in range(args.steps):
            x = torch.randn(32, 64, device=engine.device)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
