"""examples/train_ddp.py with the hook's what-if trace recording switched on.

Run as a rank of tests.support.RankJob: TRACE_DIR and TRACE_EVERY come from the environment, the
rest of the arguments (fault injection included) go to the example unchanged. With
UNTRACED_SLOW_RANK=R and UNTRACED_SECONDS=S, rank R also sleeps S seconds in every
`optimizer.zero_grad()`: host work between the traced ops, which the trace does not show.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import time

import torch

import robust_metrics
from robust_metrics.workloads.ending import exit_process

robust_metrics.watch = functools.partial(  # type: ignore[assignment]
    robust_metrics.watch, trace_dir=os.environ["TRACE_DIR"],
    trace_every=int(os.environ.get("TRACE_EVERY", "1")),
    trace_steps=int(os.environ.get("TRACE_STEPS", "1")), checkpoint_signal=None)

import train_ddp  # noqa: E402

if os.environ.get("UNTRACED_SLOW_RANK") == os.environ.get("RANK"):
    _zero_grad = torch.optim.Optimizer.zero_grad
    _untraced = float(os.environ.get("UNTRACED_SECONDS", "0.05"))

    def _slow_zero_grad(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(_untraced)
        return _zero_grad(self, *args, **kwargs)

    torch.optim.Optimizer.zero_grad = _slow_zero_grad  # type: ignore[method-assign]

if __name__ == "__main__":
    train_ddp.main()
    exit_process()  # see robust_metrics.workloads.ending
