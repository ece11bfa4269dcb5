"""Ports for local services and rank endpoints: never one that gloo's connections can take."""

from __future__ import annotations

import socket

from robust_metrics import processes


def test_blocks_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    floor = processes._ephemeral_floor()
    handed: set[int] = set()
    for _ in range(50):
        base = processes.free_port_block(4)
        block = set(range(base, base + 4))
        assert max(block) < floor  # gloo's outgoing connections and bind(0) draw from above
        assert not handed & block
        handed |= block
    assert processes.free_port() not in handed


def test_a_block_with_a_taken_port_is_passed_over(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("0.0.0.0", processes.free_port()))
        taken = held.getsockname()[1]
        processes._handed_out.discard(taken)  # as if another program had bound it
        candidates = iter([taken - 1, taken - 1, taken + 1])
        monkeypatch.setattr(processes.random, "randint", lambda lo, hi: next(candidates))
        assert processes.free_port_block(2) == taken + 1
