"""The demo's training job: a small transformer language model on gloo ranks, with the hook.

Started by the demo's `local` scheduler (one process per rank, env:// rendezvous). It checkpoints
every `--checkpoint-every` steps and whenever robust-metrics asks, and resumes from the last
checkpoint after a restart. Faults are injected at run time through `faults.json` in the run
folder, so the demo can play a script against a live job:

    {"slow_rank": 2, "slow_seconds": 0.2}   rank 2 sleeps in every forward
    {"nan_rank": 1, "nan_in_steps": 3}       rank 1's loss is NaN 3 steps after it reads this
    {"hang_rank": 3, "hang_step": 200}       rank 3 stops at step 200; its peers wait in all_reduce
                                             (or "hang_in_steps": 3)
    {"crash_rank": 1, "crash_step": 9}       rank 1 raises once it completed global step 9, in
                                             every start that reaches it (a crash loop)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import robust_metrics
from robust_metrics.workloads.ending import exit_process


class TinyLM(nn.Module):
    """Two transformer layers over a 256-token vocabulary."""

    def __init__(self, vocab: int = 256, width: int = 64, layers: int = 2, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width,
                                           batch_first=True, dropout=0.0)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.slow_seconds = 0.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.slow_seconds:
            time.sleep(self.slow_seconds)
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.layers(h))


class Faults:
    """Reads `faults.json` when it changes (one stat per step).

    `<name>_in_steps: n` becomes `<name>_step: the step it was read at + n`, so the fault script
    can aim at a step without knowing exactly where the job is.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mtime = 0
        self.spec: dict[str, Any] = {}

    def poll(self, step: int) -> dict[str, Any]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return self.spec
        if mtime != self.mtime:
            with contextlib.suppress(ValueError):  # half-written: read again next step
                spec = json.loads(self.path.read_text())
                for key in [k for k in spec if k.endswith("_in_steps")]:
                    spec[key.removesuffix("_in_steps") + "_step"] = step + int(spec.pop(key))
                self.spec, self.mtime = spec, mtime
        return self.spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True, help="folder for checkpoints and faults.json")
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds of extra work per step")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--trace-every", type=int, default=25,
                   help="record 2 of every N steps for the what-if analysis (0: off)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    ckpt = run_dir / "checkpoint.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"rank {rank}: resumed from checkpoint at step {start}", flush=True)

    def save(step: int) -> None:
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, f"{ckpt}.tmp")
            os.replace(f"{ckpt}.tmp", ckpt)

    handle = robust_metrics.watch(ddp, optimizer, checkpoint=save, start_step=start,
                                  topology={"dp_rank": rank, "pp_rank": 0, "tp_rank": 0},
                                  trace_dir=str(run_dir / "trace" / f"from-step-{start}"),
                                  trace_every=args.trace_every,
                                  trace_steps=2)
    faults = Faults(run_dir / "faults.json")
    generator = torch.Generator().manual_seed(rank)
    with handle:
        for step in range(start, args.steps):
            spec = faults.poll(step)
            model.slow_seconds = float(spec.get("slow_seconds", 0.0)) if spec.get(
                "slow_rank") == rank else 0.0
            if spec.get("hang_rank") == rank and step >= int(spec.get("hang_step", 0)):
                print(f"rank {rank}: hanging at step {step}", flush=True)
                while True:
                    time.sleep(1)
            tokens = torch.randint(0, 256, (8, 33), generator=generator)
            logits = ddp(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
            if spec.get("nan_rank") == rank and step == int(spec.get("nan_step", -1)):
                loss = loss * float("nan")
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            if torch.isfinite(norm):
                optimizer.step()
            else:  # skip the poisoned update, but still end the step for the hook
                optimizer.zero_grad(set_to_none=False)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if spec.get("crash_rank") == rank and step + 1 >= int(spec.get("crash_step", 0)):
                raise RuntimeError(f"rank {rank}: injected crash after step {step + 1}")
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                handle.checkpoint()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process()  # see robust_metrics.workloads.ending
