"""Whole numbers spelled in untrusted text: rank labels, file names, headers, query parameters.

`str.isdigit()` is true for '²' and '①', which `int()` refuses, and `int()` refuses more than
4,300 digits: a name or label that passes the one and fails the other raised ValueError where
the caller had already decided the text was a number.
"""

from __future__ import annotations

MAX_DIGITS = 18  # below 2**63: a pid, a rank, a byte count or a limit


def decimal(text: str) -> int | None:
    """The number `text` spells in 1 to 18 ASCII digits, else None."""
    if text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS:
        return int(text)
    return None


def rank_order(rank: str) -> tuple[int, str]:
    """Sort key of a rank label: numbers in numeric order first, then any other label by text."""
    number = decimal(rank)
    return (1 << 63, rank) if number is None else (number, rank)
