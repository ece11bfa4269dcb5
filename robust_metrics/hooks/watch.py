"""`watch(model, optimizer)`: the one line that instruments a PyTorch training loop.

Step boundaries come from the optimizer's step post-hook, data wait from the model's forward
pre-hook, the loss from the 0-dim tensor `backward()` runs on, the gradient norm from
`clip_grad_norm_` or the optimizer's pre-step hook, GC pauses from `gc.callbacks`, collectives from
`robust_metrics.hooks.collectives`. Every hook body is guarded: an exception inside robust-metrics
is counted in `robust_hook_errors_total{where}`, logged once, and never reaches the training loop.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from robust_metrics import schema
from robust_metrics.hooks import frameworks, parallelism
from robust_metrics.hooks.collectives import CollectiveTracker, compiling, group_label
from robust_metrics.hooks.config import WatchOptions, valid_flops
from robust_metrics.hooks.numerics import (
    DeferredReader,
    LossAccumulator,
    SpikeDetector,
    grad_norm_tensor,
    is_finite,
)
from robust_metrics.hooks.sinks import MultiprocessSink, NullSink, Sink, make_sink
from robust_metrics.hooks.store import MetricStore
from robust_metrics.rankfolder.control import ControlChannel
from robust_metrics.rankfolder.identity import write_identity

__all__ = ["Watch", "watch"]

log = logging.getLogger("robust_metrics")
F = TypeVar("F", bound=Callable[..., Any])

_active: Watch | None = None
_active_lock = threading.Lock()


def _guard(where: str) -> Callable[[F], F]:
    """Run a hook body; on any exception count it, log it once, and return None."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(self: Watch, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                self._error(where, exc)
                return None

        return guarded  # type: ignore[return-value]

    return decorate


class Watch:
    """Handle returned by `watch()`. Use as a context manager, or call `close()` at the end."""

    def __init__(self, model: Any, optimizer: Any, options: WatchOptions) -> None:
        self.parallelism = parallelism.resolve(model)
        # Topology the user gave wins; the rest comes from the DeviceMesh or pipeline stage.
        options.topology = {**self.parallelism.topology, **options.topology}
        self.options = options
        self.model = model
        self.modules = self.parallelism.modules
        self.optimizer = optimizer
        self.store = MetricStore({"run": options.run, "rank": str(options.rank)})
        self.global_step = options.start_step
        self._nonfinite_step: int | None = None  # see _first_nonfinite
        self._batch: int | None = None  # the batch position of the step being submitted
        self._closed = False
        self._logged_errors: set[str] = set()
        self._handles: list[Any] = []
        self._restore: list[Callable[[], None]] = []
        self._reader = DeferredReader()
        self._losses = LossAccumulator()
        self._grad_norm_from_clip: Any = None
        self._last_step_end: float | None = None
        self._awaiting_forward = True
        self._gc_started = 0.0
        self._flush_lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._flusher_stop = threading.Event()
        self._phase = "train"
        self._started = time.time()
        self._loss_spikes = SpikeDetector(relative=0.1)
        self._grad_norm_spikes = SpikeDetector(relative=0.5)
        self.tracker = CollectiveTracker(self._error)
        self._steps_taken = 0  # optimizer steps seen by the post-hook: tells a skipped one
        self._skipped_steps: Any = None  # robust_skipped_steps_total, once a GradScaler steps
        self._skipping = False
        self._ddp_probe: Any = None
        self.control = ControlChannel(
            options.metrics_dir, options.checkpoint_signal if options.checkpoint else None,
            options.control_poll_interval,
            annotations_path=options.pod_annotations if options.checkpoint else None,
            on_error=self._error)
        self._bind_series()
        self.sink: Sink = self._open_sink()
        self._install()
        self._flush(force=True)
        self._start_flusher()
        atexit.register(self._close_at_exit)

    # -- set-up ----------------------------------------------------------------------------
    def _bind_series(self) -> None:
        s, st = schema, self.store
        self._steps = st.series(s.STEPS_TOTAL)
        self._last_step_ts = st.series(s.LAST_STEP_TIMESTAMP)
        self._global_step = st.series(s.GLOBAL_STEP)
        self._start_step = st.series(s.START_STEP)
        self._step_duration = st.series(s.STEP_DURATION)
        self._step_compute = st.series(s.STEP_COMPUTE)
        self._step_compute_squared = st.series(s.STEP_COMPUTE_SQUARED)
        self._data_wait = st.series(s.DATA_WAIT)
        self._gc_pause = st.series(s.GC_PAUSE)
        # robust_loss and robust_grad_norm appear with their first real value: a placeholder 0
        # would be scraped as a loss and drag the spike baselines down.
        self._nonfinite_loss = st.series(s.NONFINITE_LOSS)
        self._nonfinite_grad = st.series(s.NONFINITE_GRAD)
        self._ckpt_request = st.series(s.CHECKPOINT_REQUEST_ID)
        self._ckpt_ts = st.series(s.LAST_CHECKPOINT_TIMESTAMP)
        self._ckpt_duration = st.series(s.CHECKPOINT_DURATION)
        self._ckpt_failures = st.series(s.CHECKPOINT_FAILURES)
        self._phases = {p: st.series(s.PHASE, phase=p) for p in schema.PHASES}
        # Only with flops_per_step: a job that does not count FLOPs spends no series on it.
        self._model_flops = (st.series(s.MODEL_FLOPS)
                             if self.options.flops_per_step is not None else None)
        self._global_step.set(self.global_step)
        self._start_step.set(self.global_step)
        self._set_phase("train")
        o = self.options
        info = {"local_rank": str(o.local_rank), "world_size": str(o.world_size), "node": o.node,
                "pid": str(os.getpid())}
        for key in ("dp_rank", "pp_rank", "tp_rank"):
            info[key] = str(o.topology[key]) if key in o.topology else ""
        st.series(s.RANK_INFO, **info).set(1)
        st.on_read(self._guarded_refresh)
        self._cuda = self._cuda_device()
        if self._cuda is not None:
            self._cuda_series = [st.series(m) for m in (s.CUDA_ALLOCATED, s.CUDA_RESERVED,
                                                        s.CUDA_PEAK)]

    def _open_sink(self) -> Sink:
        o = self.options
        try:
            sink = make_sink(o.backend, self.store, directory=o.metrics_dir, port=o.port)
        except ValueError:
            raise
        except Exception as exc:  # a full disk or a taken port must not stop training
            self._error("sink", exc)
            return NullSink()
        if isinstance(sink, MultiprocessSink):
            self._write_identity()
            sink.on_reopen = self._write_identity
        return sink

    @_guard("identity")
    def _write_identity(self, finished: float | None = None,
                        crashed: float | None = None) -> None:
        """`ranks/<pid>.json` lets the sidecar map processes to ranks for liveness and stacks;
        `finished` (written by a normal close) tells it that the exit to come is not a crash;
        `crashed` (written when an exception ends the rank) when it failed, on the rank's clock,
        so the first rank to fail is told from the peers that fail of it even when no scrape
        saw them alive."""
        o = self.options
        write_identity(str(o.metrics_dir), run=o.run, rank=o.rank, local_rank=o.local_rank,
                       node=o.node, world_size=o.world_size, topology=o.topology,
                       started=self._started, finished=finished, crashed=crashed,
                       flush_interval=o.flush_interval or None)

    def _cuda_device(self) -> Any:
        with contextlib.suppress(Exception):
            params = list(self.modules[0].parameters()) if self.modules else []
            if params and params[0].is_cuda:
                return params[0].device
        return None

    def _install(self) -> None:
        import torch

        o = self.options
        if self.optimizer is not None:  # DeepSpeed's steps itself: hooks/frameworks.py
            restore = frameworks.patch_framework_step(self.optimizer, self._on_framework_step)
            if restore is not None:
                self._restore.append(restore)
            else:
                optimizer = unwrap_optimizer(self.optimizer)
                self._handles.append(optimizer.register_step_pre_hook(self._on_pre_step))
                self._handles.append(optimizer.register_step_post_hook(self._on_step_end))
        for module in self.modules:  # before FSDP2's own pre-forward (its all-gather)
            self._handles.append(module.register_forward_pre_hook(self._on_forward, prepend=True))
        self._patch(torch.Tensor, "backward", self._wrap_backward)
        self._install_grad_scaler()
        for module in (torch.nn.utils, torch.nn.utils.clip_grad):
            self._patch(module, "clip_grad_norm_", self._wrap_clip)
        self._restore.extend(frameworks.patch_clip_with_norm(self._on_clip_norm))
        self._restore.extend(frameworks.patch_given_loss(self.model, self._capture_given_loss))
        if o.gc_pauses:
            gc.callbacks.append(self._on_gc)
            self._restore.append(lambda: gc.callbacks.remove(self._on_gc))
        if o.collectives:
            self._install_collectives()
        if o.trace_every:  # sampled op traces for `robust-metrics whatif`; nothing when off
            self._install_trace()
        if self.control.install_signal():
            self._restore.append(self.control.restore_signal)

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._restore.append(lambda: setattr(owner, name, original))

    @_guard("collectives")
    def _install_collectives(self) -> None:
        import torch.distributed as dist

        from robust_metrics.hooks.timing import StepTimer, source_for

        self.tracker.timer = StepTimer(source_for(self._cuda))  # CUDA events on GPU models
        self.tracker.patch()
        self._restore.append(self.tracker.unpatch)
        if not self.tracker.timer.source.host:  # where the step's stream waits for FSDP2's
            self._install_streams()
        if not (dist.is_available() and dist.is_initialized()):
            return
        self.tracker.watch_group(None)  # the default group; others on their first collective
        ddp = torch_ddp_class()
        wrapped = [m for m in self.modules if ddp is not None and isinstance(m, ddp)]
        if wrapped:
            self._install_ddp_probe(wrapped[0])

    def _install_streams(self) -> None:
        """The step's CUDA stream waiting for collectives on side streams is blocked time."""
        from robust_metrics.hooks import streams

        for (owner, name), original in streams.patch(self.tracker).items():
            self._restore.append(functools.partial(setattr, owner, name, original))

    def _install_ddp_probe(self, model: Any) -> None:
        """DDP keeps its C++ all-reduce; its exposed tail is timed from two points per step."""
        from robust_metrics.hooks.timing import DdpProbe

        tracker, group = self.tracker, group_label(model.process_group)
        tracker.watch_group(model.process_group)  # NCCL: its buckets by completion hook
        probe = DdpProbe(model, tracker.timer, on_error=self._error,
                         on_launch=lambda: tracker.ddp_launch(group),
                         on_window=lambda ready, end: tracker.ddp_reduction(
                             group, probe.nbytes, ready, end))
        self._restore.append(probe.install())
        self._ddp_probe = probe

    @_guard("trace")
    def _install_trace(self) -> None:
        from robust_metrics.hooks.trace import TraceRecorder

        o, tracker = self.options, self.tracker
        recorder = TraceRecorder(
            trace_dir=str(o.trace_dir), every=o.trace_every, steps=o.trace_steps, rank=o.rank,
            topology=o.topology, on_error=self._error, current_step=lambda: self.global_step,
            source=tracker.timer.source, ddp_window=lambda: tracker.timer.last_window)
        self._restore.extend(recorder.install(self.modules, self.optimizer))
        tracker.on_span = recorder.add_collective

    # -- hooks -----------------------------------------------------------------------------
    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        @functools.wraps(original)
        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not watch._closed:
                watch._capture_loss(tensor)
            return original(tensor, *args, **kwargs)

        return backward

    @_guard("loss")
    def _capture_loss(self, tensor: Any) -> None:
        if tensor.dim() == 0 and tensor.is_floating_point():
            self._losses.add(tensor, source=LossAccumulator.CAPTURED)

    def _wrap_clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        @functools.wraps(original)
        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            total = original(*args, **kwargs)
            watch._grad_norm_from_clip = total
            return total

        return clip_grad_norm_

    def _on_clip_norm(self, total: Any) -> None:
        self._grad_norm_from_clip = total

    @_guard("loss")
    def _capture_given_loss(self, loss: Any) -> None:
        """The loss handed to a framework's backward, before it divides it by the gradient
        accumulation steps."""
        if hasattr(loss, "dim") and loss.dim() == 0 and loss.is_floating_point():
            self._losses.add(loss, source=LossAccumulator.GIVEN)

    @_guard("step")
    def _on_framework_step(self, optimizer: Any, norm: Any) -> None:
        if norm is not None:  # the norm the framework computed over every rank's gradients
            self._grad_norm_from_clip = norm
        self._on_step_end(optimizer, (), {})

    def _install_grad_scaler(self) -> None:
        """A step the GradScaler skips (its scaled gradients overflowed) is still a step of the
        loop: counted, timed and published, so the step count, step time and hang age follow the
        loop, and a collapsing loss scale shows as robust_skipped_steps_total. The loss it is
        asked to scale is published unscaled."""
        try:
            from torch.amp import GradScaler
        except Exception:
            return
        self._patch(GradScaler, "step", self._wrap_scaler_step)
        self._patch(GradScaler, "scale", self._wrap_scaler_scale)

    def _wrap_scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        @functools.wraps(original)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if watch._closed or not watch._steps_through(scaler, optimizer):
                return original(scaler, optimizer, *args, **kwargs)
            before = watch._steps_taken
            result = original(scaler, optimizer, *args, **kwargs)
            if watch._steps_taken == before:  # the optimizer's step never ran: skipped
                watch._on_skipped_step(optimizer)
            return result

        return step

    @_guard("grad_scaler")
    def _steps_through(self, scaler: Any, optimizer: Any) -> bool:
        """True when `scaler` is enabled and steps the watched optimizer; creates the counter."""
        if self.optimizer is None or not scaler.is_enabled():
            return False
        if unwrap_optimizer(optimizer) is not unwrap_optimizer(self.optimizer):
            return False
        if self._skipped_steps is None:
            self._skipped_steps = self.store.series(schema.SKIPPED_STEPS)
        return True

    @_guard("grad_scaler")
    def _on_skipped_step(self, optimizer: Any) -> None:
        self._skipped_steps.inc()
        self._skipping = True
        try:
            self._on_step_end(optimizer, (), {})
        finally:
            self._skipping = False

    def _wrap_scaler_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        watch = self

        @functools.wraps(original)
        def scale(scaler: Any, outputs: Any) -> Any:
            if not watch._closed:
                watch._capture_unscaled_loss(scaler, outputs)
            return original(scaler, outputs)

        return scale

    @_guard("loss")
    def _capture_unscaled_loss(self, scaler: Any, outputs: Any) -> None:
        if (scaler.is_enabled() and hasattr(outputs, "dim") and outputs.dim() == 0
                and outputs.is_floating_point()):
            self._losses.add(outputs, source=LossAccumulator.SCALED)

    @_guard("forward")
    def _on_forward(self, module: Any, inputs: Any) -> None:
        if compiling():  # a compiled module traces its hooks: stay out of the graph
            return
        if self._awaiting_forward:
            self._awaiting_forward = False
            now = time.perf_counter()
            if self._last_step_end is None:
                self._last_step_end = now
            else:
                self._data_wait.observe(now - self._last_step_end)

    @_guard("grad_norm")
    def _on_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._grad_norm_from_clip is not None or not self.options.grad_norm:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total = grad_norm_tensor(params)
        if total is not None:
            self._grad_norm_from_clip = total

    @_guard("step")
    def _on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps_taken += 1
        now = time.perf_counter()
        started = self._last_step_end if self._last_step_end is not None else now
        duration = now - started
        for seconds, blocked in self._timed_steps(duration):  # on GPUs: earlier steps' events
            self._step_duration.observe(seconds)
            compute = max(0.0, seconds - blocked)
            self._step_compute.observe(compute)
            self._step_compute_squared.inc(compute * compute)
        self._steps.inc()
        if self._model_flops is not None:
            self._count_flops()
        self.global_step += 1
        self._global_step.set(self.global_step)
        self._last_step_ts.set(time.time())
        self._submit_numerics()
        self._reader.poll()
        self._check_control(now)
        self._flush()
        self._last_step_end = time.perf_counter()
        self._awaiting_forward = True

    @_guard("flops")
    def _count_flops(self) -> None:
        """Add this step's model FLOPs: the number given, or what the callable returns now."""
        given = self.options.flops_per_step
        flops = given() if callable(given) else given
        if not valid_flops(flops):
            raise ValueError(f"flops_per_step returned {flops!r}, not a finite number >= 0")
        self._model_flops.inc(float(flops))  # type: ignore[union-attr]

    def _timed_steps(self, host_seconds: float) -> list[tuple[float, float]]:
        """(step, blocked) seconds of the steps now readable (robust_metrics.hooks.timing)."""
        if not self.options.collectives:
            return [(host_seconds, 0.0)]
        if self._ddp_probe is not None:
            self._ddp_probe.step_end()
        return self.tracker.timer.step_end(host_seconds)

    def _submit_numerics(self) -> None:
        # The values are read a step late on GPUs: each carries the step (and batch) it
        # belongs to.
        step = self.global_step
        self._batch = self._position()
        taken = self._losses.take()
        if taken is not None:
            total, count = taken  # divided on the host once read: no extra tensor op per step
            if hasattr(total, "detach"):
                batch = self._batch
                self._reader.submit(total, lambda value: self._record_loss(value / count, step,
                                                                           batch))
            else:
                self._record_loss(float(total) / count, step, self._batch)
        norm, self._grad_norm_from_clip = self._grad_norm_from_clip, None
        if norm is not None and not self._skipping:  # an overflow the scaler skipped: not NaN
            if hasattr(norm, "detach"):
                batch = self._batch
                self._reader.submit(norm, lambda value: self._record_grad_norm(value, step,
                                                                               batch))
            else:
                self._record_grad_norm(float(norm), step, self._batch)

    def _record_loss(self, value: float, step: int, batch: int | None = None) -> None:
        self.store.series(schema.LOSS, initial=value).set(value)
        if not is_finite(value):
            self._nonfinite_loss.inc()
            self._first_nonfinite(step, batch)
        elif self._loss_spikes.update(value):  # created at the first spike: no series budget
            self.store.series(schema.LOSS_SPIKES).inc()

    def _record_grad_norm(self, value: float, step: int, batch: int | None = None) -> None:
        self.store.series(schema.GRAD_NORM, initial=value).set(value)
        if not is_finite(value):
            self._nonfinite_grad.inc()
            self._first_nonfinite(step, batch)
        elif self._grad_norm_spikes.update(value):
            self.store.series(schema.GRAD_NORM_SPIKES).inc()

    def _first_nonfinite(self, step: int, batch: int | None) -> None:
        """Name the step (and batch) of this process's first non-finite value, once: the bridge
        compares the step with the one where it recurs, or not, after a restart."""
        if self._nonfinite_step is None or step < self._nonfinite_step:
            self._nonfinite_step = step
            self.store.series(schema.NONFINITE_FIRST_STEP).set(step)
            if batch is not None:
                self.store.series(schema.NONFINITE_FIRST_BATCH).set(batch)

    @_guard("batch_position")
    def _call_position(self) -> int | None:
        value = self.options.batch_position() if self.options.batch_position else None
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"batch_position returned {value!r}, not an int")
        return value

    def _position(self) -> int | None:
        """This step's batch position from the user's callable (None when not given or when it
        failed: a hook error, never an exception in training)."""
        if self.options.batch_position is None:
            return None
        return self._call_position()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self._gc_pause.observe(time.perf_counter() - self._gc_started)
            self._gc_started = 0.0

    # -- checkpoints -----------------------------------------------------------------------
    @_guard("control")
    def _check_control(self, now: float) -> None:
        if self.options.checkpoint is None:
            return
        request = self.control.poll(now)
        if request is None or (request.at_step is not None and self.global_step < request.at_step):
            return
        self.control.handled_id = request.id
        self.checkpoint(request_id=request.id)

    def checkpoint(self, request_id: int | None = None) -> bool:
        """Run the checkpoint callback now, in the checkpoint phase; True when it succeeded."""
        fn = self.options.checkpoint
        if fn is None:
            raise RuntimeError("watch() was given no checkpoint= callback")
        previous = self._phase
        self._set_phase("checkpoint")
        self._flush(force=True)
        started = time.perf_counter()
        ok = False
        try:
            fn(self.global_step)
            ok = True
        except Exception as exc:
            self._ckpt_failures.inc()
            log.exception("robust-metrics: checkpoint callback failed at step %d: %s",
                          self.global_step, exc)
        finally:
            if ok:
                self._ckpt_duration.set(time.perf_counter() - started)
                self._ckpt_ts.set(time.time())
            if request_id is not None:
                self._ckpt_request.set(request_id)
            self._set_phase(previous)
            self._flush(force=True)
        return ok

    # -- public API ------------------------------------------------------------------------
    def loss(self, value: Any) -> None:
        """Publish this micro-step's loss explicitly (wins over the loss captured from backward)."""
        try:
            self._losses.add(value, source=LossAccumulator.EXPLICIT)
        except Exception as exc:
            self._error("loss", exc)

    def phase(self, name: str) -> _PhaseScope:
        """Enter phase `name` (train, eval, checkpoint). As a context manager, restore on exit.

        Hang and slowness alerts stay silent outside `train`, so evaluation and checkpointing
        never look like a stuck job.
        """
        if name not in schema.PHASES:
            raise ValueError(f"phase {name!r}: choose one of {', '.join(schema.PHASES)}")
        previous = self._phase
        self._enter_phase(name)
        return _PhaseScope(self, previous)

    def _enter_phase(self, name: str) -> None:
        if name == "train" and self._phase != "train":
            self._last_step_end = None  # time spent outside training is not part of a step
            # nor is time blocked in its collectives (a barrier while rank 0 writes the
            # checkpoint): counted in the next step, it would zero the waiting ranks' compute
            # time and make the writer look slow. The timer's restart forgets both.
            self.tracker.timer.restart()
            self._awaiting_forward = True
        self._set_phase(name)
        self._flush(force=True)

    def set_step(self, step: int) -> None:
        """Tell the hook the global step after resuming from a checkpoint."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be an integer >= 0")
        self.global_step = step
        self._global_step.set(step)
        self._start_step.set(step)

    def close(self) -> None:
        """Remove every hook and patch, publish the last values and that this rank finished
        normally (its exit is then no crash), release the sink."""
        self._close(finished=True)

    def _close_at_exit(self) -> None:
        """At interpreter exit without close(): finished unless an exception ended the program
        (the interpreter keeps it in sys.last_value before running exit handlers)."""
        crashed = getattr(sys, "last_value", None) is not None
        self._close(finished=not crashed)

    def _close(self, finished: bool) -> None:
        global _active
        if self._closed:
            return
        self._closed = True
        ended = time.time()
        with contextlib.suppress(Exception):
            atexit.unregister(self._close_at_exit)
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.remove()
        for restore in reversed(self._restore):
            with contextlib.suppress(Exception):
                restore()
        self._reader.poll()
        self._flusher_stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        try:
            with self._flush_lock:
                self.sink.close(self.store)
        except Exception as exc:
            self._error("sink", exc)
        if self.options.backend == "multiprocess" and not isinstance(self.sink, NullSink):
            if finished:
                self._write_identity(finished=time.time())
            else:
                self._write_identity(crashed=ended)
        with _active_lock:
            if _active is self:
                _active = None

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # An exception leaving the `with` block is a crash, not a normal end.
        self._close(finished=exc_type is None)

    # -- internals -------------------------------------------------------------------------
    def _set_phase(self, name: str) -> None:
        if name == "train" and self._phase != "train":
            # Progress resumes now: the fresh timestamp is written before the phase flips, so no
            # scrape sees `train` with the age of the last step before the phase (a false hang).
            self._last_step_ts.set(time.time())
        self._phase = name
        for phase, series in self._phases.items():
            series.set(1.0 if phase == name else 0.0)

    def _flush(self, force: bool = False) -> None:
        """Write the store to the sink: at once when forced or with no flush interval; otherwise
        the flusher thread writes it every `flush_interval` seconds."""
        if not force and self._flusher is not None:
            return
        with self._flush_lock:
            try:
                self.sink.flush(self.store)
            except Exception as exc:
                self._error("flush", exc)

    def _flush_loop(self) -> None:
        """Keep the files current while the training thread is blocked (a hang) or busy."""
        while not self._flusher_stop.wait(self.options.flush_interval):
            self._flush(force=True)

    def _start_flusher(self) -> None:
        if self.options.flush_interval > 0 and isinstance(self.sink, MultiprocessSink):
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                             name="robust-metrics-flush")
            self._flusher.start()

    @_guard("refresh")
    def _guarded_refresh(self) -> None:
        self._update_collectives()
        if self._cuda is not None:
            self._update_cuda()

    def _update_collectives(self) -> None:
        s, st = schema, self.store
        stats, entered, completed = self.tracker.snapshot()
        for (op, group), value in stats.items():
            summary = st.series(s.COLLECTIVE_DURATION, op=op, group=group)
            summary.count, summary.sum = float(value.count), value.seconds
            st.series(s.COLLECTIVE_BYTES, op=op, group=group).value = float(value.bytes)
        for group, count in entered.items():
            st.series(s.COLLECTIVES_ENTERED, group=group).value = float(count)
        for group, count in completed.items():
            st.series(s.COLLECTIVES_COMPLETED, group=group).value = float(count)

    def _update_cuda(self) -> None:
        import torch

        values = (torch.cuda.memory_allocated(self._cuda), torch.cuda.memory_reserved(self._cuda),
                  torch.cuda.max_memory_allocated(self._cuda))
        for series, value in zip(self._cuda_series, values, strict=True):
            series.set(float(value))

    def _error(self, where: str, exc: BaseException) -> None:
        try:
            self.store.series(schema.HOOK_ERRORS, where=where).inc()
            if where not in self._logged_errors:
                self._logged_errors.add(where)
                log.warning("robust-metrics: error in %s hook (training continues): %r",
                            where, exc, exc_info=exc)
        except Exception:
            pass


class _PhaseScope:
    """What `phase()` returns: already in the phase; leaving a `with` block (or calling
    `restore()`) goes back to the phase before."""

    def __init__(self, watch: Watch, previous: str) -> None:
        self._watch = watch
        self._previous = previous

    def restore(self) -> None:
        self._watch._enter_phase(self._previous)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.restore()


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate, Lightning), whose `step()`
    is the one that runs the step hooks."""
    seen = 0
    while not hasattr(optimizer, "_optimizer_step_pre_hooks") and seen < 4:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None:
            break
        optimizer, seen = inner, seen + 1
    return optimizer


def torch_ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    except Exception:
        return None


def watch(model: Any = None, optimizer: Any = None, **options: Any) -> Watch:
    """Instrument a training loop with one line, after the model and optimizer exist.

    Options (all optional; the environment fills the rest):
      run: job identity label (default: SLURM_JOB_ID, TORCHELASTIC_RUN_ID, ... or 'local');
      rank, local_rank, world_size, node: default from RANK/LOCAL_RANK/WORLD_SIZE/SLURM_* env;
      backend: 'auto' (multiprocess if ROBUST_METRICS_DIR is set, else http), 'multiprocess',
        'http', 'otel' or 'null';
      metrics_dir: multiprocess folder (default ROBUST_METRICS_DIR);
      port: in-process /metrics port (default ROBUST_METRICS_PORT or 9750, plus local rank);
      topology: {'dp_rank': .., 'pp_rank': .., 'tp_rank': ..} for robust_rank_info;
      checkpoint: fn(step) run at the next step boundary after a request (SIGUSR1 or sidecar);
      checkpoint_signal: the signal that requests a checkpoint (default SIGUSR1, None for none);
      pod_annotations: on Kubernetes, the downward API file of the pod's annotations (default
        ROBUST_METRICS_POD_ANNOTATIONS); a new `robust-metrics.io/checkpoint-request` id there
        requests a checkpoint (docs/schedulers.md);
      start_step: global step when resuming (or call handle.set_step(n));
      grad_norm: compute the gradient norm when clip_grad_norm_ is not called (default True);
      collectives: time torch.distributed collectives and DDP's gradient reduction, the
        compute/blocked split (default True; robust_metrics.hooks.timing);
      gc_pauses: time Python GC pauses (default True);
      flush_interval: seconds between writes of the multiprocess files by a background thread,
        so a hung rank's files stay current (default 0.25; 0 writes at every step end).
      trace_dir, trace_every, trace_steps: record trace_steps steps out of every trace_every
        (0: off) as what-if op traces in trace_dir (robust_metrics.hooks.trace, docs/whatif.md);
      flops_per_step: the model FLOPs this rank computes in one optimizer step (for a dense
        transformer about 6 x parameters x tokens of this rank's batch, its share under tensor
        or pipeline parallelism), or a callable taking no argument that returns them at each step
        (variable sequence lengths). It must be a Python number: a tensor would need a device
        synchronisation and is counted as a hook error. Publishes robust_model_flops_total, from
        which alert_rules/mfu.yml computes achieved FLOP/s and MFU (default None: no series).
      batch_position: a callable taking no argument that returns where this step's batch is
        in the data (a sample offset, a shard and index folded into one int), called once per
        step; at the first non-finite value the hook publishes it as
        robust_nonfinite_first_batch beside robust_nonfinite_first_step, so the bad batch can
        be found (default None: not called).

    Raises TypeError or ValueError for bad options; nothing raised later reaches the training loop.
    """
    global _active
    resolved = WatchOptions.resolve(**options)
    with _active_lock:
        if _active is not None and not _active._closed:
            raise RuntimeError("robust_metrics.watch() is already active in this process; "
                               "close() the first handle before watching again")
        _active = Watch(model, optimizer, resolved)
        return _active
