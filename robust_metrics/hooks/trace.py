"""Sampled op traces for the what-if straggler analysis (`robust-metrics whatif TRACE_DIR`).

With `watch(..., trace_dir=DIR, trace_every=N, trace_steps=K)` every rank records K consecutive
steps out of every N (steps whose number modulo N is below K; all ranks pick the same steps),
one JSON line per op in the what-if schema, into `DIR/trace-rank<R>.jsonl`:

- `forward-compute` per microbatch: the model's forward pre-hook to its forward hook;
- `backward-compute` per microbatch: `Tensor.backward()`, ending when DDP launches the step's
  last gradient bucket (the end of backward compute) when that is known;
- `grads-reduce-scatter`: DDP's gradient all-reduce, last bucket launch to last bucket done, so
  its transfer time (end - the latest start over DP ranks) excludes waiting for a straggler;
- `gc`: Python GC pauses of the step, summed, placed after the last compute;
- `optimizer`: `optimizer.step()`;
- anything else the user marks with `span(optype)`, e.g. pipeline p2p
  (`with span("forward-send"): dist.send(...)`).

dp_rank and stage come from `topology` (`dp_rank`, `pp_rank`), else dp_rank = rank, stage 0.
Times are wall-clock seconds (comparable across processes of a node; across nodes as good as
clock synchronisation). They are host times, exact for CPU work; for CUDA work they are host-side
and need `torch.cuda.synchronize` semantics to be meaningful (documented in docs/whatif.md).
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

__all__ = ["TraceRecorder", "span"]

_active: TraceRecorder | None = None


class TraceRecorder:
    """Records the ops of sampled steps of one rank and appends them as JSON lines."""

    def __init__(self, *, trace_dir: str, every: int, steps: int, rank: int,
                 topology: dict[str, int], on_error: Callable[[str, BaseException], None],
                 current_step: Callable[[], int], ddp_window: Callable[[], tuple[float, float]]
                 | None = None) -> None:
        self.every, self.steps = every, steps
        self.rank = rank
        self.dp_rank = int(topology.get("dp_rank", rank))
        self.stage = int(topology.get("pp_rank", 0))
        self.on_error = on_error
        self.current_step = current_step
        self.ddp_window = ddp_window
        self.path = os.path.join(trace_dir, f"trace-rank{rank}.jsonl")
        os.makedirs(trace_dir, exist_ok=True)
        self._file: Any = None
        self._offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self._in_step = False
        self.sampled = False
        self.step = -1
        self._ops: list[tuple[str, float, float, int]] = []  # optype, start, end, mb
        self._forward_start = 0.0
        self._backward: list[tuple[float, float]] = []
        self._forwards = 0
        self._gc_total = 0.0
        self._gc_started = 0.0
        self._opt_start = 0.0
        self._window: tuple[float, float] = (0.0, 0.0)
        self.steps_written = 0

    def is_sampled(self, step: int) -> bool:
        return self.every > 0 and step % self.every < self.steps

    def _now(self) -> float:
        return time.perf_counter() + self._offset

    # -- installation ----------------------------------------------------------------------------
    def install(self, model: Any, optimizer: Any) -> list[Callable[[], None]]:
        """Register the hooks; return the functions that remove them (call in reverse order)."""
        import torch

        global _active
        undo: list[Callable[[], None]] = []
        if model is not None:
            for handle in (model.register_forward_pre_hook(self._guard(self._on_forward_pre)),
                           model.register_forward_hook(self._guard(self._on_forward))):
                undo.append(handle.remove)
        if optimizer is not None:
            for handle in (optimizer.register_step_pre_hook(self._guard(self._on_opt_pre)),
                           optimizer.register_step_post_hook(self._guard(self._on_opt_post))):
                undo.append(handle.remove)
        original = torch.Tensor.backward
        torch.Tensor.backward = self._wrap_backward(original)
        undo.append(lambda: setattr(torch.Tensor, "backward", original))
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

    def _on_forward_pre(self, module: Any, inputs: Any) -> None:
        if not self._in_step:
            self._begin_step()
        if self.sampled:
            self._forward_start = self._now()

    def _on_forward(self, module: Any, inputs: Any, output: Any) -> None:
        if self.sampled and self._forward_start:
            self._ops.append(("forward-compute", self._forward_start, self._now(),
                              self._forwards))
            self._forwards += 1
            self._forward_start = 0.0

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(original)
        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not recorder.sampled:
                return original(tensor, *args, **kwargs)
            began = recorder._now()
            try:
                return original(tensor, *args, **kwargs)
            finally:
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
        self._window = (0.0, 0.0)
        if self.ddp_window is not None:
            launch, done = self.ddp_window()
            if launch and done >= launch:
                self._window = (launch + self._offset, done + self._offset)

    def _on_opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_step = False
        if not self.sampled:
            return
        self.sampled = False
        self._ops.append(("optimizer", self._opt_start, self._now(), -1))
        self._finish_backward()
        self._write()

    def _finish_backward(self) -> None:
        launch, done = self._window
        last_compute = 0.0
        for mb, (began, ended) in enumerate(self._backward):
            if launch and began <= launch <= ended and mb == len(self._backward) - 1:
                ended = launch  # compute ends when the last gradient bucket is launched
            self._ops.append(("backward-compute", began, ended, mb))
            last_compute = max(last_compute, ended)
        if launch and done:
            self._ops.append(("grads-reduce-scatter", launch, done, -1))
        after = last_compute or max((e for _, _, e, _ in self._ops), default=self._now())
        self._ops.append(("gc", after, after + self._gc_total, -1))

    def add_span(self, optype: str, began: float, ended: float) -> None:
        """Record a user-marked op (see `span`) in the current sampled step."""
        if self.sampled:
            self._ops.append((optype, began + self._offset, ended + self._offset, -1))

    # -- output ------------------------------------------------------------------------------------
    def _write(self) -> None:
        seq: dict[str, int] = {}
        lines = []
        for optype, began, ended, mb in sorted(self._ops, key=lambda o: (o[1], o[0])):
            k = seq.get(optype, 0)
            seq[optype] = k + 1
            compute = optype.endswith("-compute")
            lines.append(json.dumps({
                "dp_rank": self.dp_rank, "stage": self.stage, "rank": self.rank,
                "step": self.step, "optype": optype, "start_ts": began,
                "duration": max(0.0, ended - began), "seq_id": k,
                "mc": 0 if compute or optype == "grads-reduce-scatter" else -1,
                "gmc": self.stage if compute else -1, "mb_id": mb if compute else -1}))
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
    began = time.perf_counter()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            recorder.add_span(optype, began, time.perf_counter())
