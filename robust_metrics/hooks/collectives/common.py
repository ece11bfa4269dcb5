"""What every interception path shares: reading a call's arguments, labelling its group, sizing
its payload, stepping aside inside `torch.compile`, marking its wrappers.

The helpers that run inside a wrapper are plain functions, looked up as module globals, so that
a wrapper costs what it did when they were private to one module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["WRAPPED", "argument", "compiling", "group_label", "is_wrapped", "mark_wrapped",
           "parameter_index", "payload_bytes"]

WRAPPED = "_robust_metrics"  # set on every wrapper: a second watch never wraps a wrapper


def mark_wrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as one of these wrappers; returns it."""
    setattr(fn, WRAPPED, True)
    return fn


def is_wrapped(fn: Any) -> bool:
    """Whether `fn` is already one of these wrappers (a second watch, or an unrestored one)."""
    return bool(getattr(fn, WRAPPED, False))


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


def payload_bytes(value: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors; 0 for anything else."""
    nbytes = getattr(value, "nbytes", None)  # a tensor's numel x element size, in one lookup
    if type(nbytes) is int:
        return nbytes
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.numel()) * int(value.element_size())
    if isinstance(value, list | tuple):
        return sum(payload_bytes(v) for v in value)
    return 0


def compiling() -> bool:
    """True while `torch.compile` traces: wrappers then call straight through (Dynamo folds
    this to a constant, so a wrapper adds no graph break)."""
    import torch

    return torch.compiler.is_compiling()


def parameter_index(fn: Callable[..., Any], name: str) -> int | None:
    """The positional index of parameter `name` of `fn`, found once when a function is wrapped."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(name) if name in names else None


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int | None) -> Any:
    """Argument `name` of a call, given by keyword or at position `at` (None: not given)."""
    if name in kwargs:
        return kwargs[name]
    return args[at] if at is not None and at < len(args) else None
