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

__all__ = ["DeferredReader", "LossAccumulator", "grad_norm_tensor"]


class DeferredReader:
    """Reads 0-dim tensors when they are ready; hands each value to its callback, in order."""

    def __init__(self, max_pending: int = 8) -> None:
        self._pending: deque[tuple[Any, Any, Callable[[float], None]]] = deque()
        self._max_pending = max_pending

    def submit(self, tensor: Any, callback: Callable[[float], None]) -> None:
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

    Losses passed explicitly (`handle.loss(...)`) win over those captured from `backward()`, so a
    user with a scaled loss (AMP) can publish the unscaled one.
    """

    def __init__(self) -> None:
        self._sums: dict[bool, Any] = {}
        self._counts: dict[bool, int] = {True: 0, False: 0}

    def add(self, loss: Any, *, explicit: bool) -> None:
        value = loss.detach() if hasattr(loss, "detach") else float(loss)
        total = self._sums.get(explicit)
        self._sums[explicit] = value if total is None else total + value
        self._counts[explicit] += 1

    def take(self) -> tuple[Any, int] | None:
        """The summed loss (tensor or float) and its micro-step count; resets for the next step."""
        kind = bool(self._counts[True])
        result = (self._sums[kind], self._counts[kind]) if self._counts[kind] else None
        self._sums.clear()
        self._counts = {True: 0, False: 0}
        return result


def grad_norm_tensor(parameters: list[Any]) -> Any | None:
    """Total L2 norm of the gradients as a 0-dim tensor (foreach norms, no host sync)."""
    import torch

    grads = [p.grad for p in parameters if p.grad is not None]
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
