"""The `torch.distributed` functions: what FSDP2, pipeline sends and receives,
`batch_isend_irecv` and user code call.

Each collective function (`all_reduce`, `all_gather_single`, `reduce_scatter_single`, `isend`, ...)
is wrapped in `torch.distributed` and `distributed_c10d` while a watch is active. A call that
nests another (`all_gather_into_tensor` calls `all_gather_single`) counts once; a call inside a
`_coalescing_manager` block only records its op and is counted where the block issues it
(`coalesced.py`). A sync call blocks
the rank throughout; an async one is completed by its work's future, or at its wait
(`work.py`). A send or receive counts as entered per pair of ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import robust_metrics.hooks.collectives.common as common
from robust_metrics.hooks.collectives.common import argument, compiling, payload_bytes
from robust_metrics.hooks.collectives.tracker import CollectiveTracker
from robust_metrics.hooks.patches import Patches

__all__ = ["OP_KINDS", "DistributedCalls", "wrap_call"]

_ASYNC_BY_DEFAULT = {"isend", "irecv"}
_PEER_ARGUMENTS = ("dst", "src", "group_dst", "group_src")

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


class DistributedCalls(Patches):
    """Interception path: the collective functions of `torch.distributed`."""

    def install(self, tracker: CollectiveTracker) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for fn_name, op in OP_KINDS.items():
            original = getattr(c10d, fn_name, None)
            if original is None or common.is_wrapped(original):
                continue
            wrapped = wrap_call(tracker, fn_name, op, original)
            for module in (dist, c10d):
                if getattr(module, fn_name, None) is original:
                    self.replace(module, fn_name, wrapped)


def wrap_call(tracker: CollectiveTracker, fn_name: str, op: str,
              original: Callable[..., Any]) -> Callable[..., Any]:
    """A torch.distributed function, counted once however its calls nest
    (`all_gather_into_tensor` calls `all_gather_single`)."""
    always_async = fn_name in _ASYNC_BY_DEFAULT
    index = functools.partial(common.parameter_index, original)
    group_at, async_at = index("group"), index("async_op")
    peer_at = {name: index(name) for name in _PEER_ARGUMENTS} if op in ("send", "recv") else {}

    labels, scope = tracker.labels, tracker.calls  # looked up once: this runs per collective
    pairs: dict[tuple[str, int], str] = {}  # (group, peer) -> its pair label, per wrapper
    coalescing = _coalescing_groups()

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if tracker.closed or scope.depth or compiling():
            return original(*args, **kwargs)
        if coalescing and _coalesced(coalescing, argument(args, kwargs, "group", group_at)):
            return original(*args, **kwargs)  # recorded only: issued at the block's end
        try:
            pg = argument(args, kwargs, "group", group_at)
            group = labels.get(id(pg)) or tracker.label(pg)
            peer = _peer(pg, args, kwargs, peer_at) if peer_at else None
            counted = None
            if peer is not None:
                counted = pairs.get((group, peer))
                if counted is None:
                    counted = pairs[(group, peer)] = _pair_label(group, peer)
            launch = tracker.enter(op, group, payload_bytes(args[0]) if args else 0,
                                   counted, peer)
        except Exception as exc:  # accounting must never break the collective
            tracker.on_error("collectives", exc)
            return original(*args, **kwargs)
        scope.depth += 1
        try:
            result = original(*args, **kwargs)
        finally:
            scope.depth -= 1
        try:
            if result is None or not (always_async or argument(args, kwargs, "async_op",
                                                               async_at)):
                tracker.finish(launch)  # a sync call: the rank was blocked all along
            else:
                tracker.pending_work(result, launch)
        except Exception as exc:
            tracker.on_error("collectives", exc)
        return result

    return common.mark_wrapped(wrapper)


def _coalescing_groups() -> dict[Any, Any]:
    """The process groups inside a `_coalescing_manager` block now (torch's own dict, the same
    object for the life of the process; empty when none, so the check costs one truth test).
    A call on such a group only records its op; the block issues them as one collective,
    counted by `coalesced.py`."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._world.pg_coalesce_state
    except Exception:  # a torch without coalescing: nothing is ever inside a block
        return {}


def _coalesced(coalescing: dict[Any, Any], pg: Any) -> bool:
    import torch.distributed as dist

    return (pg if pg is not None else dist.distributed_c10d._get_default_group()) in coalescing


def _peer(pg: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          peer_at: dict[str, int | None]) -> int | None:
    """The global rank a send or receive connects to (from `dst`/`src` or their group ranks)."""
    import torch.distributed as dist

    for name in ("dst", "src"):
        peer = argument(args, kwargs, name, peer_at[name])
        if peer is not None:
            return int(peer)
    for name in ("group_dst", "group_src"):
        group_peer = argument(args, kwargs, name, peer_at[name])
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
