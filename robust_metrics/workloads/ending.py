"""Ending a gloo rank's process after a run that succeeded, without the interpreter's shutdown.

torch 2.13's gloo worker thread drops its reference to a finished collective a moment after the
caller's wait returns. When the interpreter has begun to finalise by then, that reference's
destructor asks for the GIL, Python ends the thread inside a C++ destructor, and the rank aborts
("terminate called without an active exception", exit -6) although its run succeeded. On this
project's 2-core machine that was 1 to 4 ranks in 4 of 13 to 7 of 25 four-rank runs of
examples/train_ddp.py, with or without `watch()`. A rank that has destroyed its process group and
closed its hook has nothing left for the shutdown to do, so it leaves at once.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

__all__ = ["exit_process"]


def exit_process(code: int = 0) -> NoReturn:
    """Flush stdout and stderr and end the process with `code`, skipping interpreter shutdown
    (exit handlers and finalisers do not run: close the hook and the process group first)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
