"""Where step and communication time is measured: the host clock, or CUDA events on the device.

On the CPU (gloo) a collective blocks the calling thread, so the host clock around it is the time
the rank was blocked. On GPUs it is not: an NCCL collective returns, and its future completes, as
soon as the work is enqueued, and `Work.wait()` only makes the current stream wait. There the
time a rank is blocked is the time its compute stream waits, which only CUDA events recorded on
that stream can see. Both are behind one small boundary, `TimingSource`:

- `mark()` records a point in the order work runs (a host time, or an event on the current
  stream), `ready(mark)` says without blocking whether that point has been reached, and
  `elapsed(a, b)` gives the seconds between two reached points.

`StepTimer` is the one estimator on top of it, for every backend: per step it collects the
intervals a rank was blocked (`(begin, end)` marks around a sync collective or a `Work.wait()`,
and for DDP the exposed tail of the gradient reduction: from when the last gradient DDP reduces
is ready to when backward returns), and at each step end returns the `(step, blocked)` seconds of
every earlier step whose marks are reached. On the host that is the step just ended; with CUDA
events it is usually the one before: nothing here ever synchronises the device.

Blocked is time the *step's* stream waits. FSDP2 issues its all-gathers and reduce-scatters as
sync calls on side streams of their own (`all_gather_single(async_op=False)` while its all-gather
stream is current), where they overlap compute: a wait there is the side stream's, not the
rank's. So an interval marked on a side stream is not counted; that stream is remembered as
carrying communication, and the step's stream waiting for an event recorded on it (FSDP2's
copy-out, its reduce-scatter waits) is the blocked time instead
(`robust_metrics.hooks.collectives.streams`). DDP's two points are found by
`robust_metrics.hooks.collectives.ddp`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["CudaEvents", "HostClock", "StepTimer", "TimingSource", "source_for"]

Mark = Any


class TimingSource(Protocol):
    """Records points where work runs and reads them later, never waiting for them."""

    host: bool  # True when a mark is a host time that is reached when it is taken

    def mark(self) -> Mark: ...
    def ready(self, mark: Mark) -> bool: ...
    def elapsed(self, begin: Mark, end: Mark) -> float: ...
    def side_stream(self) -> Any:
        """The current stream when it is not the one the step runs on, else None."""
        ...
    def is_step_stream(self, stream: Any) -> bool:
        """Whether `stream` is the one the step runs on."""
        ...


class HostClock:
    """`time.perf_counter`: right where the host is blocked (CPU tensors, gloo)."""

    host = True
    # the C function itself: a mark costs no Python frame (wrappers take two per collective)
    mark = staticmethod(time.perf_counter)

    def ready(self, mark: float) -> bool:
        return True

    def elapsed(self, begin: float, end: float) -> float:
        return end - begin

    def side_stream(self) -> None:
        return None  # the host is one thread of work: a blocked call blocks the step

    def is_step_stream(self, stream: Any) -> bool:
        return True


class CudaEvents:
    """Timing events on the current CUDA stream, read with `query()` once reached.

    `Event.record()` enqueues a marker and returns; `query()` and `elapsed_time()` of two
    completed events do not synchronise. An event is never reused: a sampled trace may still
    hold one that the step timer has already read.
    """

    host = False

    def __init__(self, device: Any = None) -> None:
        import torch

        self._event = torch.cuda.Event
        self._current: Callable[[], Any] | None = torch.cuda.current_stream
        try:  # the step's stream: the one current for the model's device when the watch starts
            self.step_stream = torch.cuda.current_stream(device)
        except Exception:  # no CUDA runtime to ask (a faked event boundary): one stream
            self.step_stream = self._current = None

    def mark(self) -> Any:
        event = self._event(enable_timing=True)
        event.record()
        return event

    def side_stream(self) -> Any:
        if self._current is None:
            return None
        stream = self._current()
        return None if stream == self.step_stream else stream

    def is_step_stream(self, stream: Any) -> bool:
        return bool(stream == self.step_stream)

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

    def elapsed(self, begin: Any, end: Any) -> float:
        return float(begin.elapsed_time(end)) / 1000.0


def source_for(device: Any) -> TimingSource:
    """CUDA events when the model lives on a CUDA device, else the host clock."""
    if device is not None and getattr(device, "type", "") == "cuda":
        return CudaEvents(device)
    return HostClock()


_MAX_SIDE_STREAMS = 64  # a job has a few (FSDP2: all-gather, reduce-scatter, all-reduce)


@dataclass
class _Step:
    begin: Mark | None
    end: Mark | None
    host_seconds: float
    intervals: list[tuple[Mark, Mark]] = field(default_factory=list)


class StepTimer:
    """Per-step time and time blocked in communication, from marks of one `TimingSource`.

    Call `blocked(begin)` after anything the rank waited in (with `begin = mark()` taken before
    it), `grad_ready()` and `backward_end()` for DDP's exposed reduction, and `step_end(host)`
    at each optimizer step; it returns `(step_seconds, blocked_seconds)` for each step now
    readable, oldest first. At most `max_pending` steps wait to be read; older ones are dropped
    (counted in `dropped`) so memory stays bounded if a device stops progressing.
    """

    def __init__(self, source: TimingSource, max_pending: int = 8) -> None:
        self.source = source
        self._host = isinstance(source, HostClock)
        self.max_pending = max_pending
        self.dropped = 0
        self._lock = threading.Lock()
        self._intervals: list[tuple[Mark, Mark]] = []
        self._ready: Mark | None = None
        self._last_end: Mark | None = None
        self._pending: deque[_Step] = deque()
        self.last_window: tuple[Mark, Mark] | None = None
        self.side_streams: set[Any] = set()  # side streams that carried a collective

    def mark(self) -> Mark:
        return self.source.mark()

    def blocked(self, begin: Mark) -> None:
        """The rank was blocked from `begin` until now (a sync collective, a `Work.wait()`).

        Unless a side stream is current (FSDP2's all-gather and reduce-scatter streams): then
        that stream waited while the step's stream may have computed, and nothing is counted
        here; the stream is remembered, so that the step's stream waiting for it counts
        (`robust_metrics.hooks.collectives.streams`).
        """
        side = None if self._host else self.source.side_stream()  # the host has one stream
        if side is not None:
            if len(self.side_streams) < _MAX_SIDE_STREAMS:
                self.side_streams.add(side)
            return
        end = self.source.mark()
        with self._lock:
            self._intervals.append((begin, end))

    def grad_ready(self) -> None:
        """A gradient DDP reduces is ready; the last such call before `backward_end` counts."""
        mark = self.source.mark()
        with self._lock:
            self._ready = mark

    def backward_end(self) -> tuple[Mark, Mark] | None:
        """Backward returned: the reduction was exposed from the last `grad_ready` until now."""
        with self._lock:
            ready, self._ready = self._ready, None
            if ready is None:
                return None
            window = (ready, self.source.mark())
            self._intervals.append(window)
            self.last_window = window
        return window

    def restart(self) -> None:
        """Time from here to the next step end is not a step (training resumes after a pause)."""
        with self._lock:
            self._last_end = None
            self._intervals = []
            self._ready = None

    def step_end(self, host_seconds: float) -> list[tuple[float, float]]:
        """Close a step; return `(step, blocked)` seconds of every step that can now be read.

        `host_seconds` is the step as the host clock saw it; it is used where the host is the
        source, and for a first step, which has no device mark to start from.
        """
        if self.source.host:  # every mark is reached: read this step now, nothing pending
            with self._lock:
                intervals, self._intervals = self._intervals, []
            return [(host_seconds, self._blocked(intervals, host_seconds))]
        end = self.source.mark()
        with self._lock:
            step = _Step(self._last_end, end, host_seconds, self._intervals)
            self._intervals = []
            self._last_end = end
            self._pending.append(step)
            while len(self._pending) > self.max_pending:
                self._pending.popleft()
                self.dropped += 1
        return self._drain()

    def _drain(self) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        while True:
            with self._lock:
                if not self._pending or not self._reached(self._pending[0]):
                    return out
                step = self._pending.popleft()
            out.append(self._read(step))

    def _reached(self, step: _Step) -> bool:
        ready = self.source.ready
        if step.end is not None and not ready(step.end):
            return False
        return all(ready(b) and ready(e) for b, e in step.intervals)

    def _read(self, step: _Step) -> tuple[float, float]:
        src = self.source
        if step.end is not None and step.begin is not None:
            seconds = src.elapsed(step.begin, step.end)
        else:
            seconds = step.host_seconds
        return seconds, self._blocked(step.intervals, seconds)

    def _blocked(self, intervals: list[tuple[Mark, Mark]], seconds: float) -> float:
        """Seconds blocked in a step: the sum of its intervals, never more than the step."""
        if not intervals:
            return 0.0
        blocked = 0.0
        if self._host:  # marks are times: no call per interval
            for b, e in intervals:
                blocked += max(0.0, e - b)
        else:
            elapsed = self.source.elapsed
            for b, e in intervals:
                blocked += max(0.0, elapsed(b, e))
        return min(blocked, max(seconds, 0.0))
