"""A selection of steps kept as inclusive ranges, so that `--steps 0-100000000000` costs two
integers instead of a set of 10**11 (which ran out of memory)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["StepRanges"]


class StepRanges:
    """Steps `lo..hi` (inclusive) for each range; `in`, iteration and `len` like a set."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        self.ranges = sorted((int(lo), int(hi)) for lo, hi in ranges)

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and any(lo <= step <= hi for lo, hi in self.ranges)

    def __iter__(self) -> Iterator[int]:
        seen: set[int] = set()
        for lo, hi in self.ranges:
            for step in range(lo, hi + 1):
                if step not in seen:
                    seen.add(step)
                    yield step

    def __len__(self) -> int:
        return len(set(self))

    def mask(self, steps: Any) -> Any:
        """A boolean array: which entries of the integer array `steps` are selected."""
        keep = steps < 0
        keep &= False
        for lo, hi in self.ranges:
            keep |= (steps >= lo) & (steps <= hi)
        return keep
