"""examples/train_ddp.py with the hook's what-if trace recording switched on.

Run as a rank of tests.support.RankJob: TRACE_DIR and TRACE_EVERY come from the environment, the
rest of the arguments (fault injection included) go to the example unchanged.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import robust_metrics
from robust_metrics.workloads.ending import exit_process

robust_metrics.watch = functools.partial(  # type: ignore[assignment]
    robust_metrics.watch, trace_dir=os.environ["TRACE_DIR"],
    trace_every=int(os.environ.get("TRACE_EVERY", "1")),
    trace_steps=int(os.environ.get("TRACE_STEPS", "1")), checkpoint_signal=None)

import train_ddp  # noqa: E402

if __name__ == "__main__":
    train_ddp.main()
    exit_process()  # see robust_metrics.workloads.ending
