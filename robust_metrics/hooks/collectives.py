"""Collective timing: count, seconds and bytes per op kind and process group, and time blocked.

Two entry points see every collective of a typical job:
- the `torch.distributed` functions (`all_reduce`, `all_gather_into_tensor`, `send`, ...), wrapped
  while a watch is active, for sync and `async_op=True` calls (FSDP, pipeline p2p, user code);
- a DDP communication hook that all-reduces gradient buckets exactly as DDP's default hook does,
  and times each bucket through its future.

Completion is observed through the work's future on gloo, and through the process group's
completion hook on NCCL (`TORCH_NCCL_ENABLE_TIMING`), so the hook never synchronises the GPU.

Time *blocked* is what separates a straggler from its victims: in a synchronous collective the slow
rank waits least. A rank is blocked for the whole of a sync call, for the time inside `Work.wait()`
of an async call, and, for DDP, from the launch of the step's last bucket (when backward compute is
done) to the completion of the last bucket.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    """Accumulates per-(op, group) stats and per-step blocked time; safe across threads."""

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self._lock = threading.Lock()
        self.stats: dict[tuple[str, str], _Stats] = {}
        self.entered: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self._blocked = 0.0
        self._ddp_last_launch = 0.0
        self._ddp_last_done = 0.0
        self._on_error = on_error
        self._patched: dict[tuple[Any, str], Any] = {}
        self._groups_timed_by_hook: set[str] = set()
        self.closed = False
        self.originals: dict[str, Callable[..., Any]] = {}

    # -- accounting ------------------------------------------------------------------------
    def launch(self, op: str, group: str, nbytes: int) -> float:
        with self._lock:
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

    def complete(self, op: str, group: str, started: float, *, blocked: bool) -> None:
        done = time.perf_counter()
        self.record_completion(op, group, done - started)
        if blocked:
            with self._lock:
                self._blocked += done - started

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

    def add_blocked(self, seconds: float) -> None:
        with self._lock:
            self._blocked += seconds

    def take_blocked(self) -> float:
        """Seconds blocked since the last call (one step), DDP tail included."""
        with self._lock:
            blocked = self._blocked + max(0.0, self._ddp_last_done - self._ddp_last_launch)
            self._blocked = 0.0
            self._ddp_last_launch = self._ddp_last_done = 0.0
        return blocked

    def snapshot(self) -> tuple[dict[tuple[str, str], _Stats], dict[str, int], dict[str, int]]:
        with self._lock:
            stats = {k: _Stats(v.count, v.seconds, v.bytes) for k, v in self.stats.items()}
            return stats, dict(self.entered), dict(self.completed)

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
                group = group_label(kwargs.get("group"))
                nbytes = _payload_bytes(args[0]) if args else 0
                started = tracker.launch(op, group, nbytes)
            except Exception as exc:  # accounting must never break the collective
                tracker._on_error("collectives", exc)
                return original(*args, **kwargs)
            result = original(*args, **kwargs)
            try:
                if result is None or not (always_async or kwargs.get("async_op")):
                    tracker.complete(op, group, started, blocked=True)
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
            lambda _f: self._guarded(self.complete, op, group, started, blocked=False))
        return _TimedWork(work, self)

    def _guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self._on_error("collectives", exc)

    # -- DDP gradient buckets ------------------------------------------------------------------
    def ddp_comm_hook(self, process_group: Any = None) -> Callable[[Any, Any], Any]:
        """A DDP comm hook equal to DDP's default all-reduce (mean), timed per bucket."""
        import torch.distributed as dist

        all_reduce = self.originals.get("all_reduce", dist.all_reduce)
        group = group_label(process_group)
        world = dist.get_world_size(process_group)
        tracker = self

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects non-GradBucket annotations
            tensor = bucket.buffer()
            tensor.div_(world)
            if tracker.closed:  # DDP cannot unregister a comm hook: after close(), just all-reduce
                return all_reduce(tensor, group=process_group, async_op=True).get_future().then(
                    lambda fut: fut.value()[0])
            started = tracker.launch("all_reduce", group, _payload_bytes(tensor))
            tracker._ddp_last_launch = started
            future = all_reduce(tensor, group=process_group, async_op=True).get_future()

            def finish(fut: Any) -> Any:
                try:
                    tracker.record_completion("all_reduce", group, time.perf_counter() - started)
                    tracker._ddp_last_done = time.perf_counter()
                except Exception as exc:
                    tracker._on_error("collectives", exc)
                return fut.value()[0]

            return future.then(finish)

        return hook

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
        self._groups_timed_by_hook.add(group)
        return True


class _TimedWork:
    """Forwards to a `Work`; time spent in `wait()` counts as blocked."""

    __slots__ = ("_tracker", "_work")

    def __init__(self, work: Any, tracker: CollectiveTracker) -> None:
        self._work = work
        self._tracker = tracker

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._tracker.add_blocked(time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
