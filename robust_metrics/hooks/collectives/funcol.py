"""Functional collectives: what DTensor, tensor and sequence parallelism communicate through.

`torch.distributed._functional_collectives` issues a collective as a C++ op and returns an
`AsyncCollectiveTensor`; the rank waits for it in `wait_tensor`, on first use of the result. Those
two Python functions are the points seen here: the issue (`funcol.all_reduce`,
`funcol.all_gather_single`, `funcol.reduce_scatter_single`, `funcol.all_to_all_single`, ... as
DTensor's redistribution calls them) counts the collective entered, the wait is time blocked and
completes it. A launch and its wait are matched by the address of the result's storage, which
the waited tensor shares. Compiled graphs issue the C++ ops themselves: inside `torch.compile`
nothing here runs, and on NCCL the process group's completion hook still times them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import robust_metrics.hooks.collectives.common as common
from robust_metrics.hooks.collectives.common import argument, compiling, group_label, payload_bytes
from robust_metrics.hooks.collectives.tracker import CollectiveTracker
from robust_metrics.hooks.patches import Patches

__all__ = ["FUNCTIONAL_OP_KINDS", "FunctionalCollectives", "group_of"]

FUNCTIONAL_OP_KINDS: dict[str, str] = {
    "broadcast": "broadcast",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_single_autograd": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_autograd": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
}


class FunctionalCollectives(Patches):
    """Interception path: the functional collectives and their `wait_tensor`."""

    def install(self, tracker: CollectiveTracker) -> None:
        try:
            import torch.distributed._functional_collectives as funcol
        except Exception:  # a torch build without distributed support
            return
        for name, op in FUNCTIONAL_OP_KINDS.items():
            original = getattr(funcol, name, None)
            if original is None or common.is_wrapped(original):
                continue
            self.replace(funcol, name, _wrap_issue(tracker, op, original))
        if not common.is_wrapped(funcol.wait_tensor):
            self.replace(funcol, "wait_tensor", _wrap_wait(tracker, funcol.wait_tensor))


def _wrap_issue(tracker: CollectiveTracker, op: str,
                original: Callable[..., Any]) -> Callable[..., Any]:
    group_at, tag_at = common.parameter_index(original, "group"), common.parameter_index(original, "tag")

    scope = tracker.calls  # looked up once: this runs per collective

    @functools.wraps(original)
    def issue(*args: Any, **kwargs: Any) -> Any:
        if tracker.closed or scope.depth or compiling():
            return original(*args, **kwargs)
        try:
            group = group_of(argument(args, kwargs, "group", group_at),
                             argument(args, kwargs, "tag", tag_at) or "")
            launch = tracker.enter(op, group, payload_bytes(args[0]) if args else 0)
        except Exception as exc:
            tracker.on_error("collectives", exc)
            return original(*args, **kwargs)
        scope.depth += 1
        try:
            result = original(*args, **kwargs)
        finally:
            scope.depth -= 1
        try:
            keys = [_storage_key(t) for t in (result if isinstance(result, list | tuple)
                                              else [result])]
            if not keys or None in keys:
                tracker.finish(launch)  # waited inside the call (tracing): blocked throughout
            else:
                for key in keys[:-1]:  # coalesced: the last result's wait completes the launch
                    tracker.pending.add(key, replace(launch, done=True))
                tracker.pending.add(keys[-1], launch)
        except Exception as exc:
            tracker.on_error("collectives", exc)
        return result

    return common.mark_wrapped(issue)


def _wrap_wait(tracker: CollectiveTracker, original: Callable[..., Any]) -> Callable[..., Any]:
    scope = tracker.calls  # looked up once: this runs per wait

    @functools.wraps(original)
    def wait_tensor(tensor: Any) -> Any:
        if tracker.closed or scope.depth or compiling():
            return original(tensor)
        begin = tracker.timer.mark()
        scope.depth += 1
        try:
            result = original(tensor)
        finally:
            scope.depth -= 1
        tracker.guarded(_waited, tracker, tensor, begin)
        return result

    return common.mark_wrapped(wait_tensor)


def _waited(tracker: CollectiveTracker, tensor: Any, begin: Any) -> None:
    key = _storage_key(tensor)
    if key is None and hasattr(tensor, "data_ptr"):
        key = int(tensor.data_ptr())  # wait_tensor is given the result's plain tensor
    tracker.waited(key if key is not None else -1, begin)


def _storage_key(tensor: Any) -> int | None:
    """The address of a collective's result storage; an `AsyncCollectiveTensor` is read through
    its `elem` (touching the wrapper itself would wait for it). None: not an async result."""
    elem = getattr(tensor, "elem", None)
    if elem is None:
        return None
    return int(elem.data_ptr())


_group_names: dict[str, str] = {}


def group_of(group: Any, tag: str = "") -> str:
    """The `group` label of a functional collective's group argument: a process group, a
    DeviceMesh, (mesh, dim), a group name or a list of ranks."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    if isinstance(group, c10d.ProcessGroup):
        return group_label(group)
    name = str(funcol._resolve_group_name(group, tag))
    label = _group_names.get(name)
    if label is None:
        label = _group_names[name] = group_label(c10d._resolve_process_group(name))
    return label
