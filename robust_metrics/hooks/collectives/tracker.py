"""The accounting every interception path reports to: count, seconds and bytes per op kind and
process group, collectives entered and completed, and the intervals a rank was blocked.

`CollectiveTracker` is told of a collective entered (`enter`), waited for (`finish`, `waited`),
or completed by its future (`pending_work`); on NCCL the process group's completion hook
(`attach_nccl_completion_hook`) counts and times them instead. It knows nothing of how a
collective was issued: that is each path's module (see `robust_metrics.hooks.collectives`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from robust_metrics import schema
from robust_metrics.hooks.collectives.common import group_label
from robust_metrics.hooks.timing import HostClock, StepTimer

if TYPE_CHECKING:
    from robust_metrics.hooks.metric_store import MetricStore

__all__ = ["CollectiveTracker", "Launch"]

log = logging.getLogger("robust_metrics.hooks.collectives")


@dataclass(slots=True)
class Launch:
    """One collective entered: its kind, group, host start, timer mark, and whether counted done."""

    op: str
    group: str
    started: float
    begin: Any
    counted: str | None = None  # where entered/completed are counted, when not `group`
    peer: int | None = None  # the global rank a send or receive connects to
    done: bool = False


class _CallScope(threading.local):
    """Per-thread depth of wrapped calls: only the outermost call of a nest is accounted."""

    depth = 0

    @property
    def inside(self) -> bool:
        return self.depth > 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


class _Pending:
    """Launches awaiting their wait, by the id of their work or tensor; bounded, so works that are
    never waited for (fire and forget) cannot grow memory: the oldest is dropped."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[int, Launch] = OrderedDict()
        self._limit = limit

    def add(self, key: int, launch: Launch) -> None:
        with self._lock:
            self._items[key] = launch
            self._items.move_to_end(key)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    def pop(self, key: int) -> Launch | None:
        with self._lock:
            return self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class _Stats:
    count: int = 0
    seconds: float = 0.0
    bytes: int = 0


class CollectiveTracker:
    """Accumulates per-(op, group) stats; blocked intervals go to the step's `StepTimer`.

    Safe across threads (async futures complete on backend threads).
    """

    def __init__(self, on_error: Callable[[str, BaseException], None],
                 timer: StepTimer | None = None) -> None:
        self._lock = threading.Lock()
        self.stats: dict[tuple[str, str], _Stats] = {}
        self.entered: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self.timer = timer if timer is not None else StepTimer(HostClock())
        self.on_error = on_error
        self._groups_timed_by_hook: dict[str, tuple[Any, int]] = {}  # group -> (pg, seq at attach)
        self.closed = False
        self.seen_groups: set[int] = set()
        # id of a process group (None: the default) -> its label, set at its first use: the
        # wrappers' hot path reads it with one dict lookup (`label()` fills it)
        self.labels: dict[int, str] = {}
        self._ddp_launched = False
        self.calls = _CallScope()
        self.pending = _Pending()
        self._no_future: set[tuple[str, str]] = set()
        # (op, peer of a send/recv, begin mark, end mark) of each collective: what-if traces
        self.on_span: Callable[[str, int | None, Any, Any], None] | None = None

    def watch_group(self, group: Any) -> None:
        """First use of a process group: an NCCL group gets the completion hook, because host
        times of NCCL calls are enqueue times (groups made after `watch()` included)."""
        self.seen_groups.add(id(group))
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self.register_group(group_label(pg))
        if dist.get_backend(pg) == "nccl" and group_label(pg) not in self._groups_timed_by_hook:
            try:
                self.attach_nccl_completion_hook(pg)
            except Exception as exc:  # e.g. a hook of the user's own is registered already
                log.info("robust-metrics: NCCL group %s not timed: %s", group_label(pg), exc)

    def label(self, group: Any) -> str:
        """The label of `group` (None: the default group), watched at its first use."""
        key = id(group)
        label = self.labels.get(key)
        if label is None:
            if key not in self.seen_groups:
                self.watch_group(group)
            label = self.labels[key] = group_label(group)
        return label

    # -- accounting ------------------------------------------------------------------------
    def launch(self, op: str, group: str, nbytes: int, counted: str | None = None) -> float:
        """Count a collective entered under `counted` (default: its group, unless the process
        group counts them itself) and its bytes under its group."""
        with self._lock:
            if group not in self._groups_timed_by_hook:
                key = counted or group
                self.entered[key] = self.entered.get(key, 0) + 1
            stats = self.stats.get((op, group))
            if stats is None:
                stats = self.stats[(op, group)] = _Stats()
            stats.bytes += nbytes
        return time.perf_counter()

    def register_group(self, group: str) -> None:
        """Publish the group's entered and completed counts at 0 before its first collective, so
        that a rank which never reaches one is visibly behind its peers (RankHang can name it)."""
        with self._lock:
            self.entered.setdefault(group, 0)
            self.completed.setdefault(group, 0)

    def complete(self, op: str, group: str, started: float, counted: str | None = None) -> None:
        """A host-observed completion: right on gloo, an enqueue on NCCL (then ignored)."""
        self.record_completion(op, group, time.perf_counter() - started, counted=counted)

    def record_completion(self, op: str, group: str, seconds: float, *, from_hook: bool = False,
                          counted: str | None = None) -> None:
        if group in self._groups_timed_by_hook and not from_hook:
            return
        with self._lock:
            key = counted or group
            self.completed[key] = self.completed.get(key, 0) + 1
            stats = self.stats.get((op, group))
            if stats is None:
                stats = self.stats[(op, group)] = _Stats()
            stats.count += 1
            stats.seconds += seconds

    def ddp_launch(self, group: str) -> None:
        """DDP's reduction of this step entered (its last bucket launched): a rank hung in it
        shows one more entered than completed, a rank that never got there one fewer."""
        if group in self._groups_timed_by_hook or not self.timer.source.host:
            return
        with self._lock:
            self.entered[group] = self.entered.get(group, 0) + 1
            self._ddp_launched = True

    def ddp_reduction(self, group: str, nbytes: int, ready: Any, end: Any) -> None:
        """One step's DDP gradient reduction, from its last bucket's launch to backward's return.

        On the host both points are times, and the window is the last bucket's launch to the
        completion of all buckets. Where a completion hook times the group (NCCL), every bucket is
        counted there with its device duration, so nothing is recorded here.
        """
        if group in self._groups_timed_by_hook or not self.timer.source.host:
            with self._lock:  # bytes only: the completion hook counts and times the buckets
                stats = self.stats.get(("all_reduce", group))
                if stats is None:
                    stats = self.stats[("all_reduce", group)] = _Stats()
                stats.bytes += nbytes
            return
        with self._lock:  # entered (when not yet), bytes and completion under one lock
            launched, self._ddp_launched = self._ddp_launched, False
            if not launched:  # the first backward, which found the parameter to watch
                self.entered[group] = self.entered.get(group, 0) + 1
            stats = self.stats.get(("all_reduce", group))
            if stats is None:
                stats = self.stats[("all_reduce", group)] = _Stats()
            stats.bytes += nbytes
            stats.count += 1
            stats.seconds += max(0.0, end - ready)
            self.completed[group] = self.completed.get(group, 0) + 1

    def snapshot(self) -> tuple[dict[tuple[str, str], _Stats], dict[str, int], dict[str, int]]:
        with self._lock:
            stats = {k: _Stats(v.count, v.seconds, v.bytes) for k, v in self.stats.items()}
            entered = dict(self.entered)
            completed = dict(self.completed)
            hooked = list(self._groups_timed_by_hook.items())
        for group, (pg, base) in hooked:  # the process group counts what DDP's C++ launches too
            with contextlib.suppress(Exception):
                entered[group] = int(pg._get_sequence_number_for_group()) - base
        return stats, entered, completed

    def publish(self, store: MetricStore) -> None:
        """Copy the counts into `store`'s collective series (when it is read)."""
        stats, entered, completed = self.snapshot()
        for (op, group), value in stats.items():
            summary = store.series(schema.COLLECTIVE_DURATION, op=op, group=group)
            summary.count, summary.sum = float(value.count), value.seconds
            store.series(schema.COLLECTIVE_BYTES, op=op, group=group).value = float(value.bytes)
        for group, count in entered.items():
            store.series(schema.COLLECTIVES_ENTERED, group=group).value = float(count)
        for group, count in completed.items():
            store.series(schema.COLLECTIVES_COMPLETED, group=group).value = float(count)

    def close(self) -> None:
        """The watch is closing: every wrapper still reachable calls straight through."""
        self.closed = True

    # -- launches, waits and completions ---------------------------------------------------
    def enter(self, op: str, group: str, nbytes: int, counted: str | None = None,
              peer: int | None = None) -> Launch:
        """A collective entered: counted, its bytes added, its start marked."""
        return Launch(op, group, self.launch(op, group, nbytes, counted), self.timer.mark(),
                       counted, peer)

    def finish(self, launch: Launch, begin: Any = None) -> None:
        """The caller waited for `launch` from `begin` (its start when None) until now."""
        self.timer.blocked(launch.begin if begin is None else begin)
        self.settle(launch)

    def settle(self, launch: Launch) -> None:
        """Count `launch` completed, once, with the host time since it was entered (what
        `complete` does, under the one lock: this runs once per collective)."""
        seconds = time.perf_counter() - launch.started
        group = launch.group
        with self._lock:
            if launch.done:
                return
            launch.done = True
            if group not in self._groups_timed_by_hook:  # else: the completion hook counts it
                key = launch.counted or group
                self.completed[key] = self.completed.get(key, 0) + 1
                stats = self.stats.get((launch.op, group))
                if stats is None:
                    stats = self.stats[(launch.op, group)] = _Stats()
                stats.count += 1
                stats.seconds += seconds
        if self.on_span is not None:
            self.on_span(launch.op, launch.peer, launch.begin, self.timer.mark())

    def pending_work(self, work: Any, launch: Launch) -> None:
        """An async `Work`: completed by its future where the backend has one (gloo
        collectives), else when it is waited for (gloo send/recv have no future)."""
        self.pending.add(id(work), launch)
        kind = (launch.op, launch.group)
        if kind in self._no_future:
            return
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented": timed at its wait instead
            self._no_future.add(kind)
            log.info("robust-metrics: %s on %s has no future; timed when waited for", *kind)
            return
        future.add_done_callback(lambda _f: self.guarded(self.settle, launch))

    def waited(self, key: int, begin: Any) -> None:
        """A wait on a work or tensor ended: blocked since `begin`; its launch, if tracked,
        completes now unless its future already said so."""
        self.timer.blocked(begin)
        launch = self.pending.pop(key)
        if launch is not None:
            self.settle(launch)

    def guarded(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self.on_error("collectives", exc)

    # -- NCCL ------------------------------------------------------------------------------
    def attach_nccl_completion_hook(self, pg: Any) -> bool:
        """On NCCL, durations come from the process group's completion hook, not futures.

        PyTorch registers it only under `TORCH_NCCL_ENABLE_TIMING=1` (else it raises, and the
        group is accounted on the host: see the README for what that loses); the hook never sets
        the variable, whose events cost NCCL/compute overlap. Returns False when the process
        group has no such hook.
        """
        register = getattr(pg, "_register_on_completion_hook", None)
        if register is None:
            return False
        group = group_label(pg)

        def on_complete(info: Any) -> None:
            try:
                op = str(getattr(info, "op_type", "unknown")).rsplit(".", 1)[-1].lower()
                op = {"allreduce": "all_reduce", "allgather": "all_gather",
                      "_allgather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter",
                      "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all",
                      "alltoall_base": "all_to_all"}.get(op, op)
                duration = getattr(info, "active_duration", None)
                seconds = duration.total_seconds() if duration is not None else 0.0
                self.record_completion(op, group, seconds, from_hook=True)
            except Exception as exc:
                self.on_error("collectives", exc)

        register(on_complete)
        base = 0
        with contextlib.suppress(Exception):
            base = int(pg._get_sequence_number_for_group())
        with self._lock:
            self._groups_timed_by_hook[group] = (pg, base)
        return True
