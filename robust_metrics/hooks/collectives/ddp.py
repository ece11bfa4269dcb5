"""DDP's gradient reduction: C++ only, seen from two points per step.

DDP keeps its own all-reduce (no Python communication hook is registered). Its exposed tail, from
when the last gradient it reduces is ready to when backward returns, is the time a rank is
blocked in it; `DdpProbe` finds those two points with post-accumulate-grad hooks and an autograd
final callback, and `DdpReducer` reports them to the tracker as one all-reduce per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from robust_metrics.hooks.collectives.common import group_label
from robust_metrics.hooks.collectives.tracker import CollectiveTracker
from robust_metrics.hooks.timing import Mark, StepTimer

__all__ = ["DdpProbe", "DdpReducer", "ddp_class", "find_ddp"]


def ddp_class() -> Any:
    """`DistributedDataParallel`, or None in a torch build without it."""
    try:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    except Exception:
        return None


def find_ddp(modules: list[Any]) -> Any:
    """The first of the watched modules that DDP wraps, or None."""
    ddp = ddp_class()
    wrapped = [m for m in modules if ddp is not None and isinstance(m, ddp)]
    return wrapped[0] if wrapped else None


class DdpReducer:
    """Interception path: DDP's reducer, through a `DdpProbe` on the DDP-wrapped model."""

    def __init__(self, model: Any, on_error: Callable[[str, BaseException], None]) -> None:
        self.model = model
        self.on_error = on_error
        self.probe: DdpProbe | None = None

    def install(self, tracker: CollectiveTracker) -> None:
        group = group_label(self.model.process_group)
        tracker.watch_group(self.model.process_group)  # NCCL: its buckets by completion hook
        # partials, not lambdas: no Python frame of their own in the step's path
        probe = DdpProbe(self.model, tracker.timer, on_error=self.on_error,
                         on_launch=functools.partial(tracker.ddp_launch, group),
                         on_window=None)
        probe.on_window = functools.partial(tracker.ddp_reduction, group, probe.nbytes)
        probe.install()
        self.probe = probe

    def restore(self) -> None:
        if self.probe is not None:
            self.probe.remove()


class DdpProbe:
    """The two points of a DDP step that bound its exposed gradient reduction.

    `grad_ready` fires from a post-accumulate-grad hook on the parameter whose gradient is ready
    last (found in the first backward, when every trainable parameter is hooked; found again if
    it stops firing), which is when DDP launches its last bucket. `backward_end` fires from an
    autograd final callback queued behind DDP's own (DDP waits for its buckets in its callback),
    which is when backward returns. `on_launch()` is told when the watched gradient is ready
    (DDP's reduction entered; in the first backward, which finds that parameter, at its first
    gradient) and
    `on_window(ready, end)` of each closed window, neither under `no_sync()`.
    """

    def __init__(self, model: Any, timer: StepTimer,
                 on_window: Callable[[Mark, Mark], None] | None,
                 on_error: Callable[[str, BaseException], None],
                 on_launch: Callable[[], None] | None = None) -> None:
        from torch.autograd import Variable

        self._queue = Variable._execution_engine.queue_callback
        self._model = model
        self._timer = timer
        self.on_window = on_window  # None: set before the first backward
        self._on_launch = on_launch
        self._on_error = on_error
        ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
        self._params = [p for n, p in model.module.named_parameters()
                        if p.requires_grad and n not in ignored]
        self._handles: list[Any] = []
        self._order: list[int] = []
        self._queued = False
        self._fired = False
        self.watched: int | None = None
        self.nbytes = sum(p.numel() * p.element_size() for p in self._params)

    def install(self) -> Callable[[], None]:
        self._hook_all()
        return self.remove

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook_all(self) -> None:
        self.remove()
        self.watched = None
        self._order = []
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self._params)]

    def _hook(self, index: int) -> Callable[[Any], None]:
        # Runs once per step (after the first backward, only the watched parameter is hooked):
        # what it reads is bound here, and the common case takes one branch.
        model, timer, on_launch = self._model, self._timer, self._on_launch

        def on_grad(param: Any) -> None:
            try:
                # False under DDP's no_sync(): that backward reduces nothing
                syncing = getattr(model, "require_backward_grad_sync", True)
                if self.watched is None:
                    if not self._order and on_launch is not None and syncing:
                        # The backward that finds the last-ready parameter: the reduction is
                        # entered with the first gradient, so that a rank waiting in the first
                        # step's reduction is told from a rank that never reached it.
                        on_launch()
                    self._order.append(index)
                elif on_launch is not None and syncing:
                    on_launch()  # DDP launches its last bucket now: entered, not done
                self._fired = True
                timer.grad_ready()
                if not self._queued:
                    self._queued = True
                    self._queue(self._requeue)
            except Exception as exc:
                self._on_error("ddp_timing", exc)

        return on_grad

    def _requeue(self) -> None:
        # Queued from a gradient hook, which may run before DDP queued its own final callback;
        # queued again from here, it runs after every callback queued so far, DDP's included.
        try:
            self._queue(self._after_backward)
        except Exception as exc:
            self._queued = False
            self._on_error("ddp_timing", exc)

    def _after_backward(self) -> None:
        self._queued = False
        try:
            window = self._timer.backward_end()
            if self.watched is None and self._order:
                self._keep(self._order[-1])
            if (window is not None and self.on_window is not None
                    and getattr(self._model, "require_backward_grad_sync", True)):
                self.on_window(*window)
        except Exception as exc:
            self._on_error("ddp_timing", exc)

    def _keep(self, index: int) -> None:
        """After the first backward, only the last-ready parameter stays hooked."""
        self.remove()
        self.watched = index
        self._handles = [self._params[index].register_post_accumulate_grad_hook(self._hook(index))]

    def step_end(self) -> None:
        """A step whose backward never fired the watched hook (the graph changed): hook all again."""
        if self.watched is not None and not self._fired:
            self._hook_all()
        self._fired = False
        self._queued = False  # a backward that raised never ran its final callbacks
