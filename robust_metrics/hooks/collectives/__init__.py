"""Collective timing: count, seconds and bytes per op kind and process group, and time blocked.

One timing model for every parallelism: one accounting, `CollectiveTracker` (`tracker.py`), and
one module per path by which collectives reach a process group. Each is seen where it is issued
and where it is waited for, never by wrapping what it returns (FSDP2 checks
`isinstance(work, Work)`):
- `distributed.py`: the `torch.distributed` functions (`all_reduce`, `all_gather_single`,
  `reduce_scatter_single`, `isend`, ...), wrapped while a watch is active: FSDP2, pipeline
  send/recv and `batch_isend_irecv`, user code. A call that nests another
  (`all_gather_into_tensor` calls `all_gather_single`) counts once;
- `coalesced.py`: what `torch.distributed._coalescing_manager` issues as one collective at
  the end of its block (Megatron-core's bucket reduce-scatters, all-reduces and all-gathers); the
  `torch.distributed` wrappers step aside inside the block, whose calls only record their ops;
- `work.py`: `Work.wait`, patched on the class: an async collective blocks its caller only there;
- `funcol.py`: the functional collectives behind DTensor and tensor parallelism, issued by
  `funcol.all_reduce`, `funcol.all_gather_single`, ..., waited for in `funcol.wait_tensor`;
- `ddp.py`: DDP's gradient reduction, C++ only, seen from two points per step;
- `streams.py`: on GPUs, where the step's CUDA stream waits for collectives issued on side
  streams (FSDP2).

Each path is an `Interception`: built with what it needs, `install(tracker)` for the life of a
watch, `restore()` at its close. What they share (argument reading, group labels, payload sizes,
`compiling()`) is `common.py`; no path imports another.

Time *blocked* is what separates a straggler from its victims: in a synchronous collective the slow
rank waits least. A rank is blocked for the whole of a sync call, for the time inside a wait of an
async one, and, for DDP, from its last gradient being ready to backward returning. These intervals
are marks of the step's `StepTimer` (host clock on the CPU, CUDA events on the current stream on
GPUs), so on NCCL they measure the time the stream waited, not the enqueue.

Per-collective durations: on the host, launch to completion (the call's return, the async work's
future, or, for works without one such as gloo's send/recv, the end of its wait); on NCCL, from the
process group's completion hook (`TORCH_NCCL_ENABLE_TIMING=1` for device-side durations), which
also sees DDP's buckets and every functional collective. There the process group's own sequence
number counts the collectives entered, and the completion hook counts those completed: a rank whose
count entered lags never launched the collective (a CPU-side hang), one whose completed count lags
launched it and the device never finished it. Inside `torch.compile`d code every wrapper steps
aside (compiled graphs issue their collectives themselves): no graph break, no recompilation.
"""

from __future__ import annotations

from typing import Protocol

from robust_metrics.hooks.collectives.common import compiling, group_label
from robust_metrics.hooks.collectives.distributed import OP_KINDS
from robust_metrics.hooks.collectives.tracker import CollectiveTracker

__all__ = ["OP_KINDS", "CollectiveTracker", "Interception", "compiling", "group_label"]


class Interception(Protocol):
    """One way collectives are issued or waited for, seen while a watch is active."""

    def install(self, tracker: CollectiveTracker) -> None:
        """Start reporting this path's collectives to `tracker`."""
        ...

    def restore(self) -> None:
        """Put back what `install` changed; safe to call when it installed nothing."""
        ...
