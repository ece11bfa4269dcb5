"""Whole numbers in untrusted text: what str.isdigit() calls digits and int() refuses."""

from __future__ import annotations

import pytest

from robust_metrics.bridge.ledger import named
from robust_metrics.bridge.nan_verdict import first_report
from robust_metrics.bridge.store import Incident
from robust_metrics.numbers import decimal, rank_order


@pytest.mark.parametrize("text", ["\u00b2", "\u2460", "\u0661", "\U0001d7d9", "1" * 19, "",
                                  "-1", "+1", " 1", "1.0", "1e3", "0x1"])
def test_only_ascii_digits_up_to_18_are_a_number(text: str) -> None:
    assert decimal(text) is None


def test_a_number_is_its_value() -> None:
    assert decimal("0") == 0 and decimal("0042") == 42 and decimal("9" * 18) == 10**18 - 1


def test_ranks_sort_by_number_then_any_other_label_by_text() -> None:
    labels = ["10", "\u00b2", "2", "b", "9" * 5000, "a", "0"]
    assert sorted(labels, key=rank_order) == ["0", "2", "10", "9" * 5000, "a", "b", "\u00b2"]


def test_a_rank_label_no_int_reads_neither_breaks_the_first_nan_nor_the_ledger() -> None:
    """Rank labels come from the job: '\u00b2' passed str.isdigit() and made int() raise in the
    bridge's sort keys."""
    assert first_report({"\u00b2": 5.0, "3": 5.0}) == ("3", 5.0)
    assert first_report({"\u00b2": 4.0, "3": 5.0}) == ("\u00b2", 4.0)
    labels = {"alertname": "RankHang", "run": "r1", "ranks": "\u00b2,3,10", "node": "n1"}
    incident = Incident(1, "fp@s", "fp", "2026-01-01T00:00:00Z", "r1", "RankHang", "r", labels,
                        {}, [], "done", "", 0, 0, 0, 0, 1)
    assert named(incident, []) == (["3", "10", "\u00b2"], ["n1"])
