"""Collective timing: count, seconds and bytes per op kind and process group, and time blocked.

Two entry points see every collective of a typical job, and neither replaces DDP's own C++
all-reduce with Python:
- the `torch.distributed` functions (`all_reduce`, `all_gather_into_tensor`, `send`, ...), wrapped
  while a watch is active, for sync and `async_op=True` calls (FSDP, pipeline p2p, user code);
- DDP's gradient reduction, seen from two points per step (`robust_metrics.hooks.timing.DdpProbe`):
  when the last gradient DDP reduces is ready and when backward returns.

Time *blocked* is what separates a straggler from its victims: in a synchronous collective the slow
rank waits least. A rank is blocked for the whole of a sync call, for the time inside `Work.wait()`
of an async call, and, for DDP, from its last gradient being ready to backward returning. These
intervals are marks of the step's `StepTimer` (host clock on the CPU, CUDA events on the current
stream on GPUs), so on NCCL they measure the time the compute stream waited, not the enqueue.

Per-collective durations: on the host, launch to completion (the call's return, or the async
work's future); on NCCL, from the process group's completion hook (`TORCH_NCCL_ENABLE_TIMING=1`
for device-side durations), which also sees each of DDP's buckets. There the process group's own
sequence number counts the collectives entered, DDP's included, and the completion hook counts
those completed: a rank whose count entered lags never launched the collective (a CPU-side hang),
one whose completed count lags launched it and the device never finished it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from robust_metrics.hooks.timing import HostClock, StepTimer

__all__ = ["OP_KINDS", "CollectiveTracker", "group_label"]

log = logging.getLogger(__name__)

# torch.distributed function name -> op kind label
OP_KINDS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_object": "all_gather",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
}
_ASYNC_BY_DEFAULT = {"isend", "irecv"}


def group_label(group: Any) -> str:
    """A bounded, human label for a process group: its description, else its name."""
    try:
        import torch.distributed as dist

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        desc = getattr(pg, "group_desc", "") or ""
        if desc and desc != "undefined":
            return desc
        return str(getattr(pg, "group_name", "") or "default_pg")
    except Exception:
        return "unknown"


def _payload_bytes(value: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors; 0 for anything else."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel()) * int(value.element_size())
    if isinstance(value, list | tuple):
        return sum(_payload_bytes(v) for v in value)
    return 0


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
        self._on_error = on_error
        self._patched: dict[tuple[Any, str], Any] = {}
        self._groups_timed_by_hook: dict[str, tuple[Any, int]] = {}  # group -> (pg, seq at attach)
        self.closed = False
        self.originals: dict[str, Callable[..., Any]] = {}
        self._seen_groups: set[int] = set()
        self._ddp_launched = False

    def watch_group(self, group: Any) -> None:
        """First use of a process group: an NCCL group gets the completion hook, because host
        times of NCCL calls are enqueue times (groups made after `watch()` included)."""
        self._seen_groups.add(id(group))
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

    # -- accounting ------------------------------------------------------------------------
    def launch(self, op: str, group: str, nbytes: int) -> float:
        """Count a collective entered (unless its process group counts them) and its bytes."""
        with self._lock:
            if group not in self._groups_timed_by_hook:
                self.entered[group] = self.entered.get(group, 0) + 1
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

    def complete(self, op: str, group: str, started: float) -> None:
        """A host-observed completion: right on gloo, an enqueue on NCCL (then ignored)."""
        self.record_completion(op, group, time.perf_counter() - started)

    def record_completion(self, op: str, group: str, seconds: float, *, from_hook: bool = False,
                          ) -> None:
        if group in self._groups_timed_by_hook and not from_hook:
            return
        with self._lock:
            self.completed[group] = self.completed.get(group, 0) + 1
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
        with self._lock:
            launched, self._ddp_launched = self._ddp_launched, False
            if not launched:  # the first backward, which found the parameter to watch
                self.entered[group] = self.entered.get(group, 0) + 1
            stats = self.stats.get(("all_reduce", group))
            if stats is None:
                stats = self.stats[("all_reduce", group)] = _Stats()
            stats.bytes += nbytes
        self.record_completion("all_reduce", group, max(0.0, end - ready))

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

    # -- torch.distributed functions ---------------------------------------------------------
    def patch(self) -> None:
        """Wrap the torch.distributed collective functions for the life of the watch."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for fn_name, op in OP_KINDS.items():
            original = getattr(c10d, fn_name, None)
            if original is None or getattr(original, "_robust_metrics", False):
                continue
            self.originals[fn_name] = original
            wrapped = self._wrap(fn_name, op, original)
            for module in (dist, c10d):
                if getattr(module, fn_name, None) is original:
                    self._patched[(module, fn_name)] = original
                    setattr(module, fn_name, wrapped)

    def unpatch(self) -> None:
        self.closed = True
        for (module, fn_name), original in self._patched.items():
            setattr(module, fn_name, original)
        self._patched.clear()

    def _wrap(self, fn_name: str, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self
        always_async = fn_name in _ASYNC_BY_DEFAULT

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                pg = kwargs.get("group")
                if id(pg) not in tracker._seen_groups:
                    tracker.watch_group(pg)
                group = group_label(pg)
                nbytes = _payload_bytes(args[0]) if args else 0
                started = tracker.launch(op, group, nbytes)
                begin = tracker.timer.mark()
            except Exception as exc:  # accounting must never break the collective
                tracker._on_error("collectives", exc)
                return original(*args, **kwargs)
            result = original(*args, **kwargs)
            try:
                if result is None or not (always_async or kwargs.get("async_op")):
                    tracker.timer.blocked(begin)
                    tracker.complete(op, group, started)
                    return result
                return tracker._track_async(result, op, group, started)
            except Exception as exc:
                tracker._on_error("collectives", exc)
                return result

        wrapper._robust_metrics = True  # type: ignore[attr-defined]
        return wrapper

    def _track_async(self, work: Any, op: str, group: str, started: float) -> Any:
        future = work.get_future()
        future.add_done_callback(
            lambda _f: self._guarded(self.complete, op, group, started))
        return _TimedWork(work, self)

    def _guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self._on_error("collectives", exc)

    # -- NCCL ------------------------------------------------------------------------------
    def attach_nccl_completion_hook(self, pg: Any) -> bool:
        """On NCCL, durations come from the process group's completion hook, not futures.

        Needs `TORCH_NCCL_ENABLE_TIMING=1` for device-side durations; returns False when the
        process group has no such hook.
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
                self._on_error("collectives", exc)

        register(on_complete)
        base = 0
        with contextlib.suppress(Exception):
            base = int(pg._get_sequence_number_for_group())
        with self._lock:
            self._groups_timed_by_hook[group] = (pg, base)
        return True


class _TimedWork:
    """Forwards to a `Work`; time spent in `wait()` counts as blocked."""

    __slots__ = ("_tracker", "_work")

    def __init__(self, work: Any, tracker: CollectiveTracker) -> None:
        self._work = work
        self._tracker = tracker

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        timer = self._tracker.timer
        begin = timer.mark()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            timer.blocked(begin)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
