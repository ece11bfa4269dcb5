"""Collective timing: count, seconds and bytes per op kind and process group, and time blocked.

One timing model for every parallelism. Collectives reach a process group by four paths, and each
is seen where it is issued and where it is waited for, never by wrapping what it returns (FSDP2
checks `isinstance(work, Work)`):
- the `torch.distributed` functions (`all_reduce`, `all_gather_single`, `reduce_scatter_single`,
  `isend`, ...), wrapped while a watch is active: FSDP2, pipeline send/recv and
  `batch_isend_irecv`, user code. A call that nests another (`all_gather_into_tensor` calls
  `all_gather_single`) counts once;
- `Work.wait`, patched on the class: an async collective blocks its caller only there;
- the functional collectives behind DTensor and tensor parallelism (`hooks/funcol.py`): issued
  by `funcol.all_reduce`, `funcol.all_gather_single`, ..., waited for in `funcol.wait_tensor`;
- DDP's gradient reduction, C++ only, seen from two points per step
  (`robust_metrics.hooks.timing.DdpProbe`).

Time *blocked* is what separates a straggler from its victims: in a synchronous collective the slow
rank waits least. A rank is blocked for the whole of a sync call, for the time inside a wait of an
async one, and, for DDP, from its last gradient being ready to backward returning. These intervals
are marks of the step's `StepTimer` (host clock on the CPU, CUDA events on the current stream on
GPUs), so on NCCL they measure the time the stream waited, not the enqueue.

Per-collective durations: on the host, launch to completion (the call's return, the async work's
future, or, for works without one such as gloo's send/recv, the end of its wait); on NCCL, from the
process group's completion hook (`TORCH_NCCL_ENABLE_TIMING=1` for device-side durations), which
also sees DDP's buckets and every functional collective. There the process group's own sequence
number counts the collectives entered, and the completion hook counts those completed: a rank whose
count entered lags never launched the collective (a CPU-side hang), one whose completed count lags
launched it and the device never finished it. Inside `torch.compile`d code every wrapper steps
aside (compiled graphs issue their collectives themselves): no graph break, no recompilation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from robust_metrics.hooks.timing import HostClock, StepTimer

__all__ = ["OP_KINDS", "CollectiveTracker", "compiling", "group_label"]

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
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_reduce_coalesced": "all_reduce",
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


def compiling() -> bool:
    """True while `torch.compile` traces: wrappers then call straight through (Dynamo folds
    this to a constant, so a wrapper adds no graph break)."""
    import torch

    return torch.compiler.is_compiling()


def _positions(fn: Callable[..., Any], name: str) -> int | None:
    """The positional index of parameter `name` of `fn`, found once when a function is wrapped."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(name) if name in names else None


_PEER_ARGUMENTS = ("dst", "src", "group_dst", "group_src")


def _peer(pg: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          peer_at: dict[str, int | None]) -> int | None:
    """The global rank a send or receive connects to (from `dst`/`src` or their group ranks)."""
    import torch.distributed as dist

    for name in ("dst", "src"):
        peer = _argument(args, kwargs, name, peer_at[name])
        if peer is not None:
            return int(peer)
    for name in ("group_dst", "group_src"):
        group_peer = _argument(args, kwargs, name, peer_at[name])
        if group_peer is not None:
            pg = pg if pg is not None else dist.distributed_c10d._get_default_group()
            return int(dist.get_global_rank(pg, int(group_peer)))
    return None


def _pair_label(group: str, peer: int) -> str:
    """Where a send or receive counts as entered: the pair of global ranks it connects, within its
    group (`pp:0-1`). A pipeline stage sends and receives more or less than its neighbours
    (the first and last stages half as much), so counts per group would name the end stages
    in every hang; within a pair, each send meets one receive and healthy counts agree."""
    import torch.distributed as dist

    low, high = sorted((int(dist.get_rank()), peer))
    return f"{group}:{low}-{high}"


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int | None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[at] if at is not None and at < len(args) else None


@dataclass
class _Launch:
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
        self._items: OrderedDict[int, _Launch] = OrderedDict()
        self._limit = limit

    def add(self, key: int, launch: _Launch) -> None:
        with self._lock:
            self._items[key] = launch
            self._items.move_to_end(key)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    def pop(self, key: int) -> _Launch | None:
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
        self._on_error = on_error
        self._patched: dict[tuple[Any, str], Any] = {}
        self._groups_timed_by_hook: dict[str, tuple[Any, int]] = {}  # group -> (pg, seq at attach)
        self.closed = False
        self.originals: dict[str, Callable[..., Any]] = {}
        self._seen_groups: set[int] = set()
        self._ddp_launched = False
        self.calls = _CallScope()
        self.pending = _Pending()
        self._no_future: set[tuple[str, str]] = set()
        # (op, peer of a send/recv, begin mark, end mark) of each collective: what-if traces
        self.on_span: Callable[[str, int | None, Any, Any], None] | None = None

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
        """Wrap the torch.distributed collective functions and `Work.wait` for the watch's life,
        and the functional collectives (DTensor, tensor parallelism; `hooks/funcol.py`)."""
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
        work_class = c10d.Work
        if not getattr(work_class.wait, "_robust_metrics", False):
            self._patched[(work_class, "wait")] = work_class.wait
            work_class.wait = self._wrap_wait(work_class.wait)
        from robust_metrics.hooks import funcol

        self._patched.update(funcol.patch(self))

    def unpatch(self) -> None:
        self.closed = True
        for (owner, fn_name), original in self._patched.items():
            setattr(owner, fn_name, original)
        self._patched.clear()

    def _wrap(self, fn_name: str, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """A torch.distributed function, counted once however its calls nest
        (`all_gather_into_tensor` calls `all_gather_single`)."""
        tracker = self
        always_async = fn_name in _ASYNC_BY_DEFAULT
        group_at, async_at = _positions(original, "group"), _positions(original, "async_op")
        peer_at = {name: _positions(original, name) for name in _PEER_ARGUMENTS} \
            if op in ("send", "recv") else {}

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if tracker.closed or tracker.calls.inside or compiling():
                return original(*args, **kwargs)
            try:
                pg = _argument(args, kwargs, "group", group_at)
                if id(pg) not in tracker._seen_groups:
                    tracker.watch_group(pg)
                group = group_label(pg)
                peer = _peer(pg, args, kwargs, peer_at) if peer_at else None
                counted = _pair_label(group, peer) if peer is not None else None
                launch = tracker.enter(op, group, _payload_bytes(args[0]) if args else 0,
                                       counted, peer)
            except Exception as exc:  # accounting must never break the collective
                tracker._on_error("collectives", exc)
                return original(*args, **kwargs)
            with tracker.calls:
                result = original(*args, **kwargs)
            try:
                if result is None or not (always_async or _argument(args, kwargs, "async_op",
                                                                    async_at)):
                    tracker.finish(launch)  # a sync call: the rank was blocked all along
                else:
                    tracker.pending_work(result, launch)
            except Exception as exc:
                tracker._on_error("collectives", exc)
            return result

        wrapper._robust_metrics = True  # type: ignore[attr-defined]
        return wrapper

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """`Work.wait` for every work object, so that code which checks
        `isinstance(work, Work)` (FSDP2) still gets the real one: the time inside is blocked."""
        tracker = self

        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if tracker.closed or tracker.calls.inside or compiling():
                return original(work, *args, **kwargs)
            begin = tracker.timer.mark()
            with tracker.calls:
                result = original(work, *args, **kwargs)
            tracker.guarded(tracker.waited, id(work), begin)
            return result

        wait._robust_metrics = True  # type: ignore[attr-defined]
        return wait

    # -- launches, waits and completions ---------------------------------------------------
    def enter(self, op: str, group: str, nbytes: int, counted: str | None = None,
              peer: int | None = None) -> _Launch:
        """A collective entered: counted, its bytes added, its start marked."""
        return _Launch(op, group, self.launch(op, group, nbytes, counted), self.timer.mark(),
                       counted, peer)

    def finish(self, launch: _Launch, begin: Any = None) -> None:
        """The caller waited for `launch` from `begin` (its start when None) until now."""
        self.timer.blocked(launch.begin if begin is None else begin)
        self.settle(launch)

    def settle(self, launch: _Launch) -> None:
        """Count `launch` completed, once, with the host time since it was entered."""
        with self._lock:
            if launch.done:
                return
            launch.done = True
        self.complete(launch.op, launch.group, launch.started, launch.counted)
        if self.on_span is not None:
            self.on_span(launch.op, launch.peer, launch.begin, self.timer.mark())

    def pending_work(self, work: Any, launch: _Launch) -> None:
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
