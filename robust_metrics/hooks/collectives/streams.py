"""Where the step's CUDA stream waits for communication issued on a side stream (FSDP2).

FSDP2 issues each all-gather as a sync call while its all-gather stream is current, records an
event there, and makes the compute stream wait for that event only when it copies the result out
(`foreach_all_gather_copy_out`); it issues each reduce-scatter on its reduce-scatter stream and
makes the compute stream wait for those events when it recycles their buffers and at the end of
backward. The side streams overlap compute: time they spend waiting for a peer is not time the
rank is blocked (`StepTimer.blocked` counts nothing while a side stream is current). The rank is
blocked where the step's stream waits for them, which these two wrappers of `torch.cuda.Stream`
see:

- `record_event` on a stream that carried a collective marks the event as communication;
- `wait_event` of such an event by the step's stream, while it is current, is timed with two
  marks on that stream around the wait: how long it stalled, as an event pair, read a step late.

`wait_stream` goes through both. Waits for anything else (a data loader's copy stream, FSDP2's
own copy-in events) are not communication and are not counted. Installed for CUDA-timed models
only, inside `torch.compile`d code they step aside like every other wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from robust_metrics.hooks.collectives.common import compiling, is_wrapped, mark_wrapped
from robust_metrics.hooks.collectives.tracker import CollectiveTracker
from robust_metrics.hooks.patches import Patches

__all__ = ["COMM", "CudaStreams", "wrap_record_event", "wrap_wait_event"]

COMM = "_robust_metrics_comm"  # attribute set on an event recorded after a side collective


def wrap_record_event(tracker: CollectiveTracker,
                      original: Callable[..., Any]) -> Callable[..., Any]:
    """`Stream.record_event`: an event recorded on a side stream that carried a collective is
    communication."""

    @functools.wraps(original)
    def record_event(stream: Any, *args: Any, **kwargs: Any) -> Any:
        event = original(stream, *args, **kwargs)
        side = tracker.timer.side_streams
        if side and not tracker.closed:
            try:
                if stream in side:
                    setattr(event, COMM, True)
            except Exception as exc:
                tracker.on_error("collectives", exc)
        return event

    return mark_wrapped(record_event)


def wrap_wait_event(tracker: CollectiveTracker,
                    original: Callable[..., Any]) -> Callable[..., Any]:
    """`Stream.wait_event`: the step's stream waiting for communication is blocked."""

    @functools.wraps(original)
    def wait_event(stream: Any, event: Any, *args: Any, **kwargs: Any) -> Any:
        if (tracker.closed or not getattr(event, COMM, False) or tracker.calls.inside
                or compiling()):
            return original(stream, event, *args, **kwargs)
        begin = None
        try:
            source = tracker.timer.source
            if source.is_step_stream(stream) and source.side_stream() is None:
                begin = tracker.timer.mark()  # on the step's stream, before its wait
        except Exception as exc:
            tracker.on_error("collectives", exc)
        result = original(stream, event, *args, **kwargs)
        if begin is not None:
            tracker.guarded(tracker.timer.blocked, begin)
        return result

    return mark_wrapped(wait_event)


class CudaStreams(Patches):
    """Interception path: `torch.cuda.Stream.record_event` and `wait_event`."""

    def install(self, tracker: CollectiveTracker) -> None:
        import torch

        stream_class = torch.cuda.Stream
        for name, wrap in (("record_event", wrap_record_event), ("wait_event", wrap_wait_event)):
            original = stream_class.__dict__.get(name)
            if original is None or is_wrapped(original):
                continue
            self.replace(stream_class, name, wrap(tracker, original))
