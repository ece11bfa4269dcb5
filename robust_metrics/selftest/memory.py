"""`memory`: write a pattern over a bounded buffer, read it back, compare.

Why: a DIMM that returns other bits than were written corrupts training silently. Three
patterns are written and verified in turn: alternating bits (0x55), their complement (0xAA),
and each 8-byte word's own index, which also catches address-line faults (two addresses that
alias show the other's index). The buffer is bounded (`size_bytes`) so the check costs a known
amount of memory and time; it proves the memory it was given, not every page of the node.

Fault injection (`memory` fault, optional `offset=N`): one byte of the buffer is flipped after the
pattern is written and before it is read, as a failing cell would.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from robust_metrics.selftest.api import CheckResult

__all__ = ["MemoryOptions", "run"]

CHUNK = 1 << 20  # bytes compared at a time, so a mismatch is located without a second pass


@dataclass(frozen=True)
class MemoryOptions:
    size_bytes: int = 256 << 20


def _patterns(size: int) -> Iterator[tuple[str, bytes]]:
    """One pattern at a time, so the check holds at most twice its buffer."""
    yield "0x55", b"\x55" * size
    yield "0xaa", b"\xaa" * size
    yield "address", array("Q", range(size // 8)).tobytes()


def _first_mismatch(buffer: bytearray, expected: bytes) -> int | None:
    """Offset of the first byte that differs, comparing chunk by chunk at C speed."""
    view = memoryview(buffer)
    for start in range(0, len(expected), CHUNK):
        stop = min(start + CHUNK, len(expected))
        if view[start:stop] != expected[start:stop]:
            return start + next(i for i in range(stop - start)
                                if view[start + i] != expected[start + i])
    return None


def run(options: MemoryOptions, fault: Mapping[str, str] | None = None) -> CheckResult:
    """Write and verify each pattern; fail naming the pattern and the first bad offset."""
    size = max(8, options.size_bytes // 8 * 8)
    buffer = bytearray(size)
    started = time.perf_counter()
    for name, expected in _patterns(size):
        buffer[:] = expected
        if fault is not None:
            offset = int(fault.get("offset", size // 2)) % size
            buffer[offset] ^= 0x01
        bad = _first_mismatch(buffer, expected)
        if bad is not None:
            return CheckResult(
                "memory", "fail", float(size), "bytes",
                f"pattern {name}: byte {bad} read back {buffer[bad]:#04x}, wrote "
                f"{expected[bad]:#04x}", data={"pattern": name, "offset": bad})
    seconds = time.perf_counter() - started
    return CheckResult("memory", "pass", float(size), "bytes",
                       f"{size} bytes written and verified with 3 patterns "
                       f"({3 * 2 * size / seconds / 1e9:.2f} GB/s)",
                       data={"patterns": 3, "bytes_per_second": 3 * 2 * size / seconds})
