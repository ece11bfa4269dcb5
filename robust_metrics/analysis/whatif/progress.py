"""A progress bar for long analyses, on stderr, that disappears when it is not wanted.

`rich` draws it when installed and stderr is a terminal; otherwise a plain one-line bar is
written, or nothing when progress is off. Results never depend on it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

__all__ = ["make_progress"]


def _plain(stream: TextIO) -> Callable[[Iterable[Any], str, int], Iterable[Any]]:
    def bar(items: Iterable[Any], label: str, total: int) -> Iterator[Any]:
        for k, item in enumerate(items):
            done = int(30 * k / max(1, total))
            stream.write(f"\r{label:>10} [{'#' * done}{'.' * (30 - done)}] {k}/{total}")
            stream.flush()
            yield item
        stream.write(f"\r{label:>10} [{'#' * 30}] {total}/{total}\n")
        stream.flush()

    return bar


def make_progress(enabled: bool, stream: TextIO | None = None,
                  ) -> Callable[[Iterable[Any], str, int], Iterable[Any]]:
    """A wrapper `progress(items, label, total)` that yields items and draws a bar."""
    stream = stream or sys.stderr
    if not enabled:
        return lambda items, label, total: items
    try:
        from rich.progress import track
    except ImportError:
        return _plain(stream)
    if not stream.isatty():
        return _plain(stream)

    def bar(items: Iterable[Any], label: str, total: int) -> Iterable[Any]:
        return track(items, description=f"what-if {label}", total=total, transient=True)

    return bar
