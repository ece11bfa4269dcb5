"""Loss and gradient-norm capture without synchronising the GPU.

The loss is the 0-dim tensor `backward()` runs on (or, under a GradScaler, the one it is asked to
scale, or the value given to `handle.loss()`); the gradient norm is what `clip_grad_norm_`
returns, else computed in the optimizer's pre-step hook. A CUDA scalar is copied to pinned host
memory with `non_blocking=True` and an event recorded after the copy; the value is read at a later
step boundary once the event has completed. On the CPU the value is read at once. So the
published loss and gradient norm on a GPU lag by about one step. `Numerics` publishes them, their
spikes and the first non-finite step.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from robust_metrics import schema
from robust_metrics.hooks import frameworks
from robust_metrics.hooks.config import WatchOptions
from robust_metrics.hooks.guard import ErrorHandler, guard
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.patches import Patches

__all__ = ["DeferredReader", "LossAccumulator", "Numerics", "SpikeDetector", "grad_norm_tensor",
           "local_tensor"]


class Numerics:
    """The loss and gradient norm of each step: captured by patching `Tensor.backward`,
    `clip_grad_norm_` and `GradScaler.scale` and by the optimizer's pre-step hook (`install()`,
    undone by `restore()`), published at each step end by `end_step()`."""

    def __init__(self, store: MetricStore, options: WatchOptions, on_error: ErrorHandler) -> None:
        self.store = store
        self.options = options
        self.on_error = on_error
        self.closed = False
        self.reader = DeferredReader()
        self.losses = LossAccumulator()
        self.grad_norm: Any = None  # this step's, from clip_grad_norm_ or the pre-step hook
        self._nonfinite_step: int | None = None  # see _first_nonfinite
        self._loss_spikes = SpikeDetector(relative=0.1)
        self._grad_norm_spikes = SpikeDetector(relative=0.5)
        self._patches = Patches()
        # robust_loss and robust_grad_norm appear with their first real value: a placeholder 0
        # would be scraped as a loss and drag the spike baselines down.
        self._nonfinite_loss = store.series(schema.NONFINITE_LOSS)
        self._nonfinite_grad = store.series(schema.NONFINITE_GRAD)
        self._loss: Any = None  # robust_loss and robust_grad_norm once created (kept: per step)
        self._grad_norm_series: Any = None

    def install(self, optimizer: Any, model: Any) -> None:
        """`optimizer`: the torch optimizer itself (unwrapped from a framework's), or None (also
        for a framework that computes the norm itself: hooks/frameworks.py); `model`: what was
        watched, whose framework's backward may be handed the loss."""
        import torch

        patches = self._patches
        if optimizer is not None:
            patches.handle(optimizer.register_step_pre_hook(self.on_pre_step))
        patches.replace(torch.Tensor, "backward", self._wrap_backward(torch.Tensor.backward))
        for undo in (*frameworks.patch_clip_with_norm(self.set_grad_norm),
                     *frameworks.patch_given_loss(model, self.capture_given_loss)):
            patches.add(undo)
        try:
            from torch.amp import GradScaler
        except Exception:
            GradScaler = None
        if GradScaler is not None:
            patches.replace(GradScaler, "scale", self._wrap_scaler_scale(GradScaler.scale))
        for module in (torch.nn.utils, torch.nn.utils.clip_grad):
            patches.replace(module, "clip_grad_norm_", self._wrap_clip(module.clip_grad_norm_))

    def restore(self) -> None:
        self._patches.restore()

    # -- capture ---------------------------------------------------------------------------
    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        numerics = self

        @functools.wraps(original)
        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not numerics.closed:
                numerics.capture_loss(tensor)
            return original(tensor, *args, **kwargs)

        return backward

    @guard("loss")
    def capture_loss(self, tensor: Any) -> None:
        if tensor.dim() == 0 and tensor.is_floating_point():
            self.losses.add(tensor, source=LossAccumulator.CAPTURED)

    @guard("loss")
    def capture_given_loss(self, loss: Any) -> None:
        """The loss handed to a framework's backward, before it divides it by the gradient
        accumulation steps."""
        if hasattr(loss, "dim") and loss.dim() == 0 and loss.is_floating_point():
            self.losses.add(loss, source=LossAccumulator.GIVEN)

    def set_grad_norm(self, total: Any) -> None:
        """The step's gradient norm as a clip or a framework computed it over every rank."""
        self.grad_norm = total

    def _wrap_clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        numerics = self

        @functools.wraps(original)
        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            total = original(*args, **kwargs)
            numerics.grad_norm = total
            return total

        return clip_grad_norm_

    def _wrap_scaler_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The loss a GradScaler is asked to scale is published unscaled."""
        numerics = self

        @functools.wraps(original)
        def scale(scaler: Any, outputs: Any) -> Any:
            if not numerics.closed:
                numerics._capture_unscaled_loss(scaler, outputs)
            return original(scaler, outputs)

        return scale

    @guard("loss")
    def _capture_unscaled_loss(self, scaler: Any, outputs: Any) -> None:
        if (scaler.is_enabled() and hasattr(outputs, "dim") and outputs.dim() == 0
                and outputs.is_floating_point()):
            self.losses.add(outputs, source=LossAccumulator.SCALED)

    @guard("grad_norm")
    def on_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.grad_norm is not None or not self.options.grad_norm:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total = grad_norm_tensor(params)
        if total is not None:
            self.grad_norm = total

    # -- publish ---------------------------------------------------------------------------
    def end_step(self, step: int, skipped: bool) -> None:
        """Submit step `step`'s loss and gradient norm (none for a step the GradScaler skipped:
        its overflow is no NaN) and publish every value read by now. The values are read a step
        late on GPUs: each carries the step (and batch) it belongs to."""
        batch = self._position()
        taken = self.losses.take()
        if taken is not None:
            total, count = taken  # divided on the host once read: no extra tensor op per step
            if hasattr(total, "detach"):
                self.reader.submit(total, lambda value: self._record_loss(value / count, step,
                                                                          batch))
            else:
                self._record_loss(float(total) / count, step, batch)
        norm, self.grad_norm = self.grad_norm, None
        if norm is not None and not skipped:
            if hasattr(norm, "detach"):
                self.reader.submit(norm, lambda value: self._record_grad_norm(value, step,
                                                                              batch))
            else:
                self._record_grad_norm(float(norm), step, batch)
        self.reader.poll()

    def _record_loss(self, value: float, step: int, batch: int | None = None) -> None:
        if self._loss is None:
            self._loss = self.store.series(schema.LOSS, initial=value)
        self._loss.set(value)
        if not math.isfinite(value):
            self._nonfinite_loss.inc()
            self._first_nonfinite(step, batch)
        elif self._loss_spikes.update(value):  # created at the first spike: no series budget
            self.store.series(schema.LOSS_SPIKES).inc()

    def _record_grad_norm(self, value: float, step: int, batch: int | None = None) -> None:
        if self._grad_norm_series is None:
            self._grad_norm_series = self.store.series(schema.GRAD_NORM, initial=value)
        self._grad_norm_series.set(value)
        if not math.isfinite(value):
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

    def _position(self) -> int | None:
        """This step's batch position from the user's callable (None when not given or when it
        failed: a hook error, never an exception in training)."""
        if self.options.batch_position is None:
            return None
        return self._call_position()

    @guard("batch_position")
    def _call_position(self) -> int | None:
        value = self.options.batch_position() if self.options.batch_position else None
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"batch_position returned {value!r}, not an int")
        return value


class DeferredReader:
    """Reads 0-dim tensors when they are ready; hands each value to its callback, in order."""

    def __init__(self, max_pending: int = 8) -> None:
        self._pending: deque[tuple[Any, Any, Callable[[float], None]]] = deque()
        self._max_pending = max_pending

    def submit(self, tensor: Any, callback: Callable[[float], None]) -> None:
        tensor = local_tensor(tensor)  # clip_grad_norm_ of DTensors returns one
        if not getattr(tensor, "is_cuda", False):
            callback(float(tensor))
            return
        import torch

        host = torch.empty((), dtype=tensor.dtype, device="cpu", pin_memory=True)
        host.copy_(tensor.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event, callback))
        while len(self._pending) > self._max_pending:  # bounded: drop the oldest unread value
            self._pending.popleft()

    def poll(self) -> None:
        """Deliver every value whose copy has finished, without waiting for the others."""
        while self._pending and self._pending[0][1].query():
            host, _, callback = self._pending.popleft()
            callback(float(host))


class LossAccumulator:
    """Sums the losses of the micro-steps of one optimizer step.

    A loss has a source, and the step publishes those of the strongest source it saw: passed
    explicitly (`handle.loss(...)`) over the one given to a framework's backward (Accelerate's,
    DeepSpeed's: before they divide it by the accumulation steps) over the one a GradScaler was
    asked to scale (unscaled, as the user computed it) over the tensor `backward()` ran on (scaled
    under AMP).
    """

    CAPTURED, SCALED, GIVEN, EXPLICIT = 0, 1, 2, 3

    def __init__(self) -> None:
        self._sums: dict[int, Any] = {}
        self._counts: dict[int, int] = {}

    def add(self, loss: Any, *, source: int) -> None:
        value = loss.detach() if hasattr(loss, "detach") else float(loss)
        total = self._sums.get(source)
        self._sums[source] = value if total is None else total + value
        self._counts[source] = self._counts.get(source, 0) + 1

    def take(self) -> tuple[Any, int] | None:
        """The summed loss (tensor or float) and its micro-step count; resets for the next step."""
        result = None
        if self._counts:
            source = max(self._counts)
            result = (self._sums[source], self._counts[source])
        self._sums.clear()
        self._counts.clear()
        return result


class SpikeDetector:
    """Says whether a value is a spike against the running statistics of earlier values.

    Rules evaluated every 15 s see a few-step spike at most once, averaged over ranks; the hook sees
    every step. Each finite value is compared with an exponential moving mean and variance over about
    `window` steps: a spike exceeds `mean + sigmas x std + relative x |mean|`. Nothing counts during
    the first `warmup` values of the process (the early loss falls fast, and a restarted process
    starts afresh), and the statistics start over halfway through it: the first steps' large values
    would otherwise inflate the variance, and hide spikes, for several windows (their weight decays
    by only (1 - 2 / (window + 1)) a step). Until they hold `window / 2` values the statistics are
    plain means, so the bar is right from the end of the warmup. Spikes are kept out of the
    statistics so that a spike of a few steps does not
    raise its own bar; after `accept_after` spikes in a row the new level is accepted (statistics
    restart, with a new warmup). Constant work per step: a few float operations.
    """

    def __init__(self, *, sigmas: float = 6.0, relative: float = 0.1, window: int = 100,
                 warmup: int = 50, accept_after: int = 20) -> None:
        self.sigmas, self.relative = sigmas, relative
        self.alpha = 2.0 / (window + 1)
        self.warmup, self.accept_after = warmup, accept_after
        self._reset()

    def _reset(self) -> None:
        self.seen = 0
        self.folded = 0  # values in the statistics since they (re)started
        self.mean = 0.0
        self.var = 0.0
        self.in_a_row = 0

    def update(self, value: float) -> bool:
        """Fold `value` in; True when it is a spike."""
        if not math.isfinite(value):
            return False
        if self.seen >= self.warmup:
            bar = self.mean + self.sigmas * math.sqrt(self.var) + self.relative * abs(self.mean)
            if value > bar:
                self.in_a_row += 1
                if self.in_a_row >= self.accept_after:
                    self._reset()
                return True
        self.in_a_row = 0
        if self.seen == self.warmup // 2:
            self.folded = 0  # the first half of the warmup stays out of the statistics
        self.folded += 1
        if self.folded == 1:
            self.mean, self.var = value, 0.0
        else:
            alpha = max(self.alpha, 1.0 / self.folded)  # 1/n: the plain mean and variance
            delta = value - self.mean
            self.mean += alpha * delta
            self.var = (1.0 - alpha) * (self.var + alpha * delta * delta)
        self.seen += 1
        return False


def local_tensor(tensor: Any) -> Any:
    """This rank's part of a DTensor (FSDP2, tensor parallel), the tensor itself otherwise.

    Reading a sharded or partial DTensor as a whole would all-reduce it: a collective the hook
    must never add. So under FSDP2 and tensor parallelism the gradient norm the hook publishes is
    the norm of this rank's gradient shard, and a non-finite value is counted by the rank that
    holds it.
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def grad_norm_tensor(parameters: list[Any]) -> Any | None:
    """L2 norm of this rank's gradients (shards, under FSDP2 or tensor parallelism) as a 0-dim
    tensor: foreach norms, no host sync, no collective."""
    import torch

    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    grads = [g for g in grads if g.numel()]
    if not grads:
        return None
    by_device: dict[Any, list[Any]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g.detach())
    norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)))
             for gs in by_device.values()]
    if len(norms) == 1:
        return norms[0]
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first, non_blocking=True) for n in norms]))
