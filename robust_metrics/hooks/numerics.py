"""Loss and gradient-norm capture without synchronising the GPU.

A CUDA scalar is copied to pinned host memory with `non_blocking=True` and an event recorded after
the copy; the value is read at a later step boundary once the event has completed. On the CPU the
value is read at once. So the published loss and gradient norm on a GPU lag by about one step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["DeferredReader", "LossAccumulator", "SpikeDetector", "grad_norm_tensor",
           "local_tensor"]


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
        if not is_finite(value):
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


def is_finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
