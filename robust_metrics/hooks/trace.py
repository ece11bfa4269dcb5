"""Sampled op traces for the what-if straggler analysis (`robust-metrics whatif TRACE_DIR`).

With `watch(..., trace_dir=DIR, trace_every=N, trace_steps=K)` every rank records K consecutive
steps out of every N (steps whose number modulo N is below K; all ranks pick the same steps),
one JSON line per op in the what-if format (`robust_metrics/optrace.py`), into
`DIR/trace-rank<R>.jsonl`:

- `forward-compute` per microbatch: the model's forward pre-hook to its forward hook;
- `backward-compute` per microbatch: `Tensor.backward()`, ending when the last gradient DDP
  reduces is ready (when DDP launches its last bucket), when that is known;
- `grads-reduce-scatter`: DDP's exposed gradient reduction, from that point to the end of
  backward, so its transfer time (end - the latest start over DP ranks) excludes waiting for a
  straggler;
- `gc`: Python GC pauses of the step, summed, placed after the last compute;
- `optimizer`: `optimizer.step()`;
- `forward-send`, `forward-recv`, `backward-send`, `backward-recv`: a pipeline stage's sends and
  receives, from the collective tracker (launch to the end of the wait);
- `backward-compute` of a pipeline stage: each `torch.autograd.backward` the schedule runs;
- anything else the user marks with `span(optype)`.

dp_rank and stage come from `topology` (`dp_rank`, `pp_rank`), else dp_rank = rank, stage 0.
Every point is a mark of the watch's timing source (`robust_metrics.hooks.timing`): the host
clock for CPU models, a CUDA event on the current stream for GPU models. A sampled step is
written once all its marks are reached, usually one step later on a GPU, and nothing waits for
the device. Times are wall-clock seconds: the step's first mark is placed at the host time it
was taken and every other op at its device offset from it, so across ranks they are as
comparable as the clocks and the host's lead over the device at the step's first forward.
Zero cost when `trace_every == 0`: nothing here is installed. Every hook body is guarded.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from robust_metrics import optrace
from robust_metrics.hooks.timing import HostClock, TimingSource

__all__ = ["TraceRecorder", "span"]

_active: TraceRecorder | None = None


class TraceRecorder:
    """Records the ops of sampled steps of one rank and appends them as JSON lines."""

    def __init__(self, *, trace_dir: str, every: int, steps: int, rank: int,
                 topology: dict[str, int], on_error: Callable[[str, BaseException], None],
                 current_step: Callable[[], int], source: TimingSource | None = None,
                 ddp_window: Callable[[], tuple[Any, Any] | None] | None = None,
                 max_pending: int = 4) -> None:
        self.every, self.steps = every, steps
        self.rank = rank
        self.dp_rank = int(topology.get("dp_rank", rank))
        self.stage = int(topology.get("pp_rank", 0))
        self.on_error = on_error
        self.current_step = current_step
        self.ddp_window = ddp_window
        self.path = os.path.join(trace_dir, optrace.file_name(rank))
        os.makedirs(trace_dir, exist_ok=True)
        self._file: Any = None
        self._offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self._in_step = False
        self.sampled = False
        self.step = -1
        self.source: TimingSource = source if source is not None else HostClock()
        self._ops: list[tuple[str, Any, Any, int]] = []  # optype, start mark, end mark, mb
        self._forward_start: Any = None
        self._backward: list[tuple[Any, Any]] = []
        self._in_backward = False
        self._forwards = 0
        self._gc_total = 0.0
        self._gc_started = 0.0
        self._opt_start: Any = None
        self._window: tuple[Any, Any] | None = None
        self._base: tuple[Any, float] | None = None  # the step's first mark, its wall time
        self._pending: list[_SampledStep] = []
        self.max_pending = max_pending
        self.steps_written = 0

    def is_sampled(self, step: int) -> bool:
        return self.every > 0 and step % self.every < self.steps

    def _now(self) -> Any:
        """A mark of the timing source; the step's first one is tied to the wall clock."""
        mark = self.source.mark()
        if self._base is None:
            self._base = (mark, time.perf_counter() + self._offset)
        return mark

    # -- installation ----------------------------------------------------------------------------
    def install(self, modules: list[Any], optimizer: Any) -> list[Callable[[], None]]:
        """Register the hooks on every module a step runs (one, or a rank's pipeline stages);
        return the functions that remove them (call in reverse order)."""
        import torch

        global _active
        undo: list[Callable[[], None]] = []
        for model in modules:
            for handle in (model.register_forward_pre_hook(self._guard(self._on_forward_pre)),
                           model.register_forward_hook(self._guard(self._on_forward))):
                undo.append(handle.remove)
        if optimizer is not None:
            for handle in (optimizer.register_step_pre_hook(self._guard(self._on_opt_pre)),
                           optimizer.register_step_post_hook(self._guard(self._on_opt_post))):
                undo.append(handle.remove)
        # Tensor.backward (a training loop) and torch.autograd.backward (what pipeline
        # schedules call per micro-batch; Tensor.backward calls it too: counted once).
        for owner in (torch.Tensor, torch.autograd):
            original = owner.backward
            owner.backward = self._wrap_backward(original)
            undo.append(functools.partial(setattr, owner, "backward", original))
        gc.callbacks.append(self._on_gc)
        undo.append(lambda: gc.callbacks.remove(self._on_gc))
        undo.append(self.close)
        _active = self
        return undo

    def _guard(self, fn: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                self.on_error("trace", exc)

        return guarded

    # -- hooks -------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        self._in_step = True
        self.step = self.current_step()
        self.sampled = self.is_sampled(self.step)
        self._ops.clear()
        self._backward.clear()
        self._forwards = 0
        self._gc_total = 0.0
        self._base = None
        self._window = None

    def _on_forward_pre(self, module: Any, inputs: Any) -> None:
        if not self._in_step:
            self._begin_step()
        if self.sampled:
            self._forward_start = self._now()

    def _on_forward(self, module: Any, inputs: Any, output: Any) -> None:
        if self.sampled and self._forward_start is not None:
            self._ops.append(("forward-compute", self._forward_start, self._now(),
                              self._forwards))
            self._forwards += 1
            self._forward_start = None

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(original)
        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not recorder.sampled or recorder._in_backward:
                return original(tensor, *args, **kwargs)
            began = recorder._now()
            recorder._in_backward = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                recorder._in_backward = False
                with contextlib.suppress(Exception):
                    recorder._backward.append((began, recorder._now()))

        return backward

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self.sampled:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self._gc_total += time.perf_counter() - self._gc_started
            self._gc_started = 0.0

    def _on_opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.sampled:
            return
        self._opt_start = self._now()
        self._window = self.ddp_window() if self.ddp_window is not None else None

    def _on_opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_step = False
        if not self.sampled:
            return
        self.sampled = False
        self._ops.append(("optimizer", self._opt_start, self._now(), -1))
        if self._base is not None:
            self._pending.append(_SampledStep(self.step, self._base, list(self._ops),
                                              list(self._backward), self._window,
                                              self._gc_total))
        del self._pending[:-self.max_pending]
        self._write_ready()

    def _write_ready(self) -> None:
        """Write every pending sampled step whose marks are all reached, oldest first."""
        while self._pending and self._pending[0].reached(self.source):
            self._write(self._pending.pop(0).resolve(self.source))

    def add_collective(self, op: str, peer: int | None, began: Any, ended: Any) -> None:
        """A collective the tracker saw. A send or receive is a pipeline op: forward when it goes
        to a later rank or comes from an earlier one (the stage order of GPipe and 1F1B; an
        interleaved schedule's wrap-around is not told apart). FSDP's per-layer all-gathers and
        reduce-scatters run inside the forward and backward they serve and stay part of those
        computes: the what-if's data-parallel ops are one per model chunk (Megatron's)."""
        if op not in ("send", "recv") or peer is None:
            return
        if not self._in_step:  # a pipeline stage's first receive comes before its forward
            self._begin_step()
        forward = (peer > self.rank) == (op == "send")
        self.add_span(f"{'forward' if forward else 'backward'}-{op}", began, ended)

    def add_span(self, optype: str, began: Any, ended: Any) -> None:
        """Record a user-marked op (see `span`) in the current sampled step."""
        if self.sampled:
            self._ops.append((optype, began, ended, -1))

    # -- output ------------------------------------------------------------------------------------
    def _write(self, step: tuple[int, list[tuple[str, float, float, int]]]) -> None:
        number, ops = step
        seq: dict[str, int] = {}
        lines = []
        for optype, began, ended, mb in sorted(ops, key=lambda o: (o[1], o[0])):
            k = seq.get(optype, 0)
            seq[optype] = k + 1
            lines.append(json.dumps(optrace.record(
                rank=self.rank, dp_rank=self.dp_rank, stage=self.stage, step=number,
                optype=optype, start=began, end=ended, seq_id=k, microbatch=mb)))
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115  closed by close()
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()
        self.steps_written += 1

    def close(self) -> None:
        global _active
        if _active is self:
            _active = None
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None


@contextlib.contextmanager
def span(optype: str) -> Iterator[None]:
    """Mark an op the hook cannot see (e.g. pipeline p2p) in the sampled trace.

    A no-op when no recorder is active or the step is not sampled.
    """
    recorder = _active
    if recorder is None or not recorder.sampled:
        yield
        return
    began = recorder._now()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            recorder.add_span(optype, began, recorder._now())


class _SampledStep:
    """A sampled step's marks, kept until the device has reached them all."""

    def __init__(self, number: int, base: tuple[Any, float], ops: list[tuple[str, Any, Any, int]],
                 backward: list[tuple[Any, Any]], window: tuple[Any, Any] | None,
                 gc_seconds: float) -> None:
        self.number, self.base, self.ops = number, base, ops
        self.backward, self.window, self.gc_seconds = backward, window, gc_seconds

    def _marks(self) -> Iterator[Any]:
        yield self.base[0]
        for _, began, ended, _ in self.ops:
            yield began
            yield ended
        for began, ended in self.backward:
            yield began
            yield ended
        if self.window is not None:
            yield from self.window

    def reached(self, source: TimingSource) -> bool:
        return all(source.ready(m) for m in self._marks())

    def resolve(self, source: TimingSource) -> tuple[int, list[tuple[str, float, float, int]]]:
        """Wall-clock seconds of every op; backward ends where DDP's last bucket launches."""
        mark0, wall0 = self.base

        def at(mark: Any) -> float:
            return wall0 + source.elapsed(mark0, mark)

        ops = [(name, at(b), at(e), mb) for name, b, e, mb in self.ops]
        launch, done = (at(self.window[0]), at(self.window[1])) if self.window else (0.0, 0.0)
        last_compute = 0.0
        for mb, (b, e) in enumerate(self.backward):
            began, ended = at(b), at(e)
            if launch and began <= launch <= ended and mb == len(self.backward) - 1:
                ended = launch  # compute ends when the last gradient bucket is launched
            ops.append(("backward-compute", began, ended, mb))
            last_compute = max(last_compute, ended)
        if launch and done >= launch and launch >= wall0:
            ops.append(("grads-reduce-scatter", launch, done, -1))
        after = last_compute or max((e for _, _, e, _ in ops), default=wall0)
        ops.append(("gc", after, after + self.gc_seconds, -1))
        return self.number, ops
