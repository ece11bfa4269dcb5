"""Step boundaries: what a step is, how long it took, how long it waited for data.

A step ends in the optimizer's step post-hook; the first forward after it (a forward pre-hook on
each watched module, before FSDP2's own) ends the wait for data. At each step end the time of the
steps now readable is split into compute and blocked (`robust_metrics.hooks.timing`), the global
step advances, and the step's loss and gradient norm, checkpoint requests and the flush follow.
A step the GradScaler skips (its scaled gradients overflowed) is still a step of the loop:
counted, timed and published, so the step count, step time and hang age follow the loop, and a
collapsing loss scale shows as robust_skipped_steps_total. GC pauses are timed from
`gc.callbacks`.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from robust_metrics import schema
from robust_metrics.hooks import frameworks
from robust_metrics.hooks.collectives.common import compiling
from robust_metrics.hooks.config import WatchOptions, valid_flops
from robust_metrics.hooks.guard import ErrorHandler, guard
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.patches import Patches
from robust_metrics.hooks.windows import StepWindows, WindowPublisher

if TYPE_CHECKING:
    from robust_metrics.hooks.collectives.ddp import DdpProbe
    from robust_metrics.hooks.collectives.tracker import CollectiveTracker

__all__ = ["STEP_SERIES", "StepHooks", "unwrap_optimizer"]

# The step's series, created first (`create_series`): sinks write series in the order they were
# created, and the step's timestamp must be written before the phase (see Watch.__init__).
STEP_SERIES = (schema.STEPS_TOTAL, schema.LAST_STEP_TIMESTAMP, schema.GLOBAL_STEP,
               schema.START_STEP, schema.STEP_DURATION, schema.STEP_COMPUTE, schema.DATA_WAIT,
               schema.GC_PAUSE)


class StepHooks:
    """The optimizer's step post-hook, the modules' forward pre-hook, the GradScaler's step and
    the GC callback. Installed by `install()`, removed by `restore()`.

    What a step end does beyond its own series is given as callables: `end_numerics(step,
    skipped)` (loss and gradient norm), `check_control(now, step)` (checkpoint requests) and
    `flush()`; `grad_norm(total)` takes the norm a framework that steps itself computed
    (hooks/frameworks.py).
    """

    def __init__(self, store: MetricStore, options: WatchOptions, tracker: CollectiveTracker, *,
                 end_numerics: Callable[[int, bool], None],
                 check_control: Callable[[float, int], None],
                 flush: Callable[[], None], grad_norm: Callable[[Any], None],
                 on_error: ErrorHandler) -> None:
        self.store, self.options, self.tracker, self.on_error = store, options, tracker, on_error
        # what a step end does beyond its own series
        self._end_numerics, self._check_control, self._flush = end_numerics, check_control, flush
        self._grad_norm = grad_norm
        self.closed = False
        self.global_step = options.start_step
        self.last_step_end: float | None = None
        self.awaiting_forward = True
        self._gc_started = 0.0
        self.steps_taken = 0  # optimizer steps seen by the post-hook: tells a skipped one
        self._skipped_steps: Any = None  # robust_skipped_steps_total, once a GradScaler steps
        self.skipping = False
        self.ddp_probe: DdpProbe | None = None
        self._optimizer: Any = None
        self._patches = Patches()
        (self._steps, self._last_step_ts, self._global_step, self._start_step,
         self._step_duration, self._step_compute, self._data_wait,
         self._gc_pause) = (store.series(spec) for spec in STEP_SERIES)
        self.windows = StepWindows(options.time_scale)
        # Timed steps to leave out of the windows: the first of a process, or after a return to
        # training, is timed from its first forward, without the wait before it, so it is no
        # step time (a restarted job's first window would be that step alone, and a threshold
        # on the window's mean would shrink with it).
        self._window_skip = 1
        store.on_read(WindowPublisher(store, self.windows).refresh)
        # Only with flops_per_step: a job that does not count FLOPs spends no series on it.
        self._model_flops = (store.series(schema.MODEL_FLOPS)
                             if options.flops_per_step is not None else None)
        self._global_step.set(self.global_step)
        self._start_step.set(self.global_step)

    @staticmethod
    def create_series(store: MetricStore) -> None:
        """Create the step's series in `store` ahead of every other part's."""
        for spec in STEP_SERIES:
            store.series(spec)

    # -- install ---------------------------------------------------------------------------
    def install(self, optimizer: Any, modules: list[Any]) -> None:
        patches = self._patches
        if optimizer is not None:
            self._optimizer = optimizer
            framework_step = frameworks.patch_framework_step(optimizer, self.on_framework_step)
            if framework_step is not None:  # DeepSpeed steps itself: hooks/frameworks.py
                patches.add(framework_step)
            else:
                patches.handle(
                    unwrap_optimizer(optimizer).register_step_post_hook(self.on_step_end))
        for module in modules:  # before FSDP2's own pre-forward (its all-gather)
            patches.handle(module.register_forward_pre_hook(self.on_forward, prepend=True))
        try:
            from torch.amp import GradScaler
        except Exception:
            GradScaler = None
        if GradScaler is not None:
            patches.replace(GradScaler, "step", self._wrap_scaler_step(GradScaler.step))
        if self.options.gc_pauses:
            callback = self.on_gc
            gc.callbacks.append(callback)
            patches.add(functools.partial(gc.callbacks.remove, callback))

    def restore(self) -> None:
        self._patches.restore()

    # -- hooks -----------------------------------------------------------------------------
    @guard("forward")
    def on_forward(self, module: Any, inputs: Any) -> None:
        if compiling():  # a compiled module traces its hooks: stay out of the graph
            return
        if self.awaiting_forward:
            self.awaiting_forward = False
            now = time.perf_counter()
            if self.last_step_end is None:
                self.last_step_end = now
            else:
                self._data_wait.observe(now - self.last_step_end)

    @guard("step")
    def on_framework_step(self, optimizer: Any, norm: Any) -> None:
        if norm is not None:  # the norm the framework computed over every rank's gradients
            self._grad_norm(norm)
        self.on_step_end(optimizer, (), {})

    @guard("step")
    def on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps_taken += 1
        now = time.perf_counter()
        started = self.last_step_end if self.last_step_end is not None else now
        duration = now - started
        ended = time.time()
        for seconds, blocked in self.timed_steps(duration):  # on GPUs: earlier steps' events
            self._step_duration.observe(seconds)
            compute = max(0.0, seconds - blocked)
            self._step_compute.observe(compute)
            if self._window_skip:
                self._window_skip -= 1
            else:
                self.windows.add(ended, seconds, compute)
        self._steps.inc()
        if self._model_flops is not None:
            self._count_flops()
        self.global_step += 1
        self._global_step.set(self.global_step)
        self._last_step_ts.set(ended)
        self._end_numerics(self.global_step, self.skipping)
        self._check_control(now, self.global_step)
        self._flush()
        self.last_step_end = time.perf_counter()
        self.awaiting_forward = True

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self._gc_pause.observe(time.perf_counter() - self._gc_started)
            self._gc_started = 0.0

    @guard("flops")
    def _count_flops(self) -> None:
        """Add this step's model FLOPs: the number given, or what the callable returns now."""
        given = self.options.flops_per_step
        flops = given() if callable(given) else given
        if not valid_flops(flops):
            raise ValueError(f"flops_per_step returned {flops!r}, not a finite number >= 0")
        self._model_flops.inc(float(flops))  # type: ignore[union-attr]

    def timed_steps(self, host_seconds: float) -> list[tuple[float, float]]:
        """(step, blocked) seconds of the steps now readable (robust_metrics.hooks.timing)."""
        if not self.options.collectives:
            return [(host_seconds, 0.0)]
        if self.ddp_probe is not None:
            self.ddp_probe.step_end()
        return self.tracker.timer.step_end(host_seconds)

    # -- the GradScaler's skipped steps ----------------------------------------------------
    def _wrap_scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        hooks = self

        @functools.wraps(original)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if hooks.closed or not hooks._steps_through(scaler, optimizer):
                return original(scaler, optimizer, *args, **kwargs)
            before = hooks.steps_taken
            result = original(scaler, optimizer, *args, **kwargs)
            if hooks.steps_taken == before:  # the optimizer's step never ran: skipped
                hooks._on_skipped_step(optimizer)
            return result

        return step

    @guard("grad_scaler")
    def _steps_through(self, scaler: Any, optimizer: Any) -> bool:
        """True when `scaler` is enabled and steps the watched optimizer; creates the counter."""
        if self._optimizer is None or not scaler.is_enabled():
            return False
        if unwrap_optimizer(optimizer) is not unwrap_optimizer(self._optimizer):
            return False
        if self._skipped_steps is None:
            self._skipped_steps = self.store.series(schema.SKIPPED_STEPS)
        return True

    @guard("grad_scaler")
    def _on_skipped_step(self, optimizer: Any) -> None:
        self._skipped_steps.inc()
        self.skipping = True
        try:
            self.on_step_end(optimizer, (), {})
        finally:
            self.skipping = False

    # -- outside training ------------------------------------------------------------------
    def resume(self) -> None:
        """Training resumes after another phase: the time spent outside it is not part of a
        step, nor is time blocked in its collectives (a barrier while rank 0 writes the
        checkpoint): counted in the next step, it would zero the waiting ranks' compute time and
        make the writer look slow. The timer's restart forgets both."""
        self.last_step_end = None
        self._window_skip = 1
        self.tracker.timer.restart()
        self.awaiting_forward = True

    def set_step(self, step: int) -> None:
        self.global_step = step
        self._global_step.set(step)
        self._start_step.set(step)


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
