"""What a watch changes outside itself, and undoes when it closes.

Every part of the hook that patches an attribute, registers a hook or appends a callback records
the undo here, so that `close()` leaves the process as it found it: the training loop, torch and
DDP run on unwrapped after a watch ends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

__all__ = ["Patches"]


class Patches:
    """Undo actions, run by `restore()` newest first; one that fails does not stop the others."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Set `owner.name` to `wrapper` until `restore()`."""
        original = getattr(owner, name)
        setattr(owner, name, wrapper)
        self._undo.append(functools.partial(setattr, owner, name, original))

    def handle(self, handle: Any) -> None:
        """A hook handle of torch (`.remove()`), removed at `restore()`."""
        self._undo.append(handle.remove)

    def add(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def restore(self) -> None:
        while self._undo:
            undo = self._undo.pop()
            with contextlib.suppress(Exception):
                undo()
