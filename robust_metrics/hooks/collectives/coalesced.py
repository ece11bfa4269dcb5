"""Collectives coalesced by `torch.distributed._coalescing_manager`: what Megatron-core issues.

Inside `with _coalescing_manager(group, async_ops=...) as cm:` a call such as `all_reduce`,
`reduce_scatter_tensor` or `all_gather_into_tensor` on that group issues nothing: it records the
op and returns a placeholder (`_IllegalWork`, or None when sync). At the block's end torch issues
all of them as one collective through the process group's own method
(`ProcessGroup.allreduce_coalesced`, `all_gather_single_coalesced`,
`reduce_scatter_single_coalesced`). Async (`async_ops=True`) it keeps the work in `cm.works` and
the caller waits with `cm.wait()`, which is `Work.wait` of that work (`work.py` times it); sync,
torch waits for the work at once, and the rank is blocked from the collective's issue, as in any
sync call (on NCCL a sync collective may run on the current stream itself, ahead of that wait).
Megatron-core's `_ParamAndGradBucketGroup.start_grad_sync` and `start_param_sync` issue every bucket group's
reduce-scatter, all-reduce and all-gather this way, and hold `cm` as the handle they wait on.

So a coalesced block is one collective, counted and completed where torch issues it: the
`torch.distributed` wrappers step aside inside the block (`distributed.py`), and these wrappers
of the process group's coalesced methods count it. Megatron imports `_coalescing_manager` by name
when it is imported, before any watch starts, so the context manager itself cannot be wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from robust_metrics.hooks.collectives.common import (
    compiling,
    is_wrapped,
    mark_wrapped,
    payload_bytes,
)
from robust_metrics.hooks.collectives.tracker import CollectiveTracker
from robust_metrics.hooks.patches import Patches

__all__ = ["COALESCED_KINDS", "CoalescedCalls", "wrap_coalesced"]

# ProcessGroup method -> op kind label (torch/distributed/distributed_c10d.py, _coalescing_manager)
COALESCED_KINDS: dict[str, str] = {
    "allreduce_coalesced": "all_reduce",
    "all_gather_single_coalesced": "all_gather",
    "reduce_scatter_single_coalesced": "reduce_scatter",
}


class CoalescedCalls(Patches):
    """Interception path: the coalesced methods of `torch.distributed.ProcessGroup`."""

    def install(self, tracker: CollectiveTracker) -> None:
        import torch.distributed as dist

        group_class = dist.ProcessGroup
        for name, op in COALESCED_KINDS.items():
            original = group_class.__dict__.get(name)
            if original is None or is_wrapped(original):
                continue
            self.replace(group_class, name, wrap_coalesced(tracker, op, original))


def wrap_coalesced(tracker: CollectiveTracker, op: str,
                   original: Callable[..., Any]) -> Callable[..., Any]:
    """A coalesced method of a process group: one collective entered, completed by its work's
    future or at its wait (the time inside the wait is blocked, `work.py`)."""

    labels, scope = tracker.labels, tracker.calls

    @functools.wraps(original)
    def coalesced(pg: Any, *args: Any, **kwargs: Any) -> Any:
        if tracker.closed or scope.depth or compiling():  # inside a wrapped call: counted there
            return original(pg, *args, **kwargs)
        try:
            group = labels.get(id(pg)) or tracker.label(pg)
            launch = tracker.enter(op, group, payload_bytes(args[0]) if args else 0)
        except Exception as exc:  # accounting must never break the collective
            tracker.on_error("collectives", exc)
            return original(pg, *args, **kwargs)
        scope.depth += 1
        try:
            work = original(pg, *args, **kwargs)
        finally:
            scope.depth -= 1
        try:
            if not getattr(args[-1] if args else None, "asyncOp", True):
                # a synchronous block: blocked from its issue on (on NCCL it may run on the
                # current stream, before the wait torch makes next), and in that wait
                tracker.timer.blocked(launch.begin)
            if work is None:
                tracker.settle(launch)
            else:
                tracker.pending_work(work, launch)
        except Exception as exc:
            tracker.on_error("collectives", exc)
        return work

    return mark_wrapped(coalesced)
