"""`Work.wait`: where an async collective blocks its caller.

Patched on the class, not by wrapping the works that calls return, so that code which checks
`isinstance(work, Work)` (FSDP2) still gets the real one. The time inside a wait is blocked; the
wait completes the launch it belongs to when the backend's work has no future (gloo's sends and
receives).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from robust_metrics.hooks.collectives.common import compiling, is_wrapped, mark_wrapped
from robust_metrics.hooks.collectives.tracker import CollectiveTracker
from robust_metrics.hooks.patches import Patches

__all__ = ["WorkWait", "wrap_wait"]


class WorkWait(Patches):
    """Interception path: `torch.distributed.Work.wait`."""

    def install(self, tracker: CollectiveTracker) -> None:
        import torch.distributed.distributed_c10d as c10d

        work_class = c10d.Work
        if not is_wrapped(work_class.wait):
            self.replace(work_class, "wait", wrap_wait(tracker, work_class.wait))


def wrap_wait(tracker: CollectiveTracker, original: Callable[..., Any]) -> Callable[..., Any]:
    """`Work.wait` for every work object: the time inside is blocked."""

    scope = tracker.calls  # looked up once: this runs per wait

    @functools.wraps(original)
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        if tracker.closed or scope.depth or compiling():
            return original(work, *args, **kwargs)
        begin = tracker.timer.mark()
        scope.depth += 1
        try:
            result = original(work, *args, **kwargs)
        finally:
            scope.depth -= 1
        try:
            tracker.waited(id(work), begin)
        except Exception as exc:
            tracker.on_error("collectives", exc)
        return result

    return mark_wrapped(wait)
