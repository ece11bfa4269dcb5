"""The incident ledger's fault time of a slow rank: when the named rank's compute per step rose,
from its raw counters in Prometheus, not the instant the alert fired (Prometheus sends that as
`startsAt`, after the rule's `for` hold, so detect time measured from it is only the delivery).
The rise is a pure function; the ledger is driven through a real action log with Prometheus
answers given at the query boundary."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from robust_metrics.bridge.config import parse
from robust_metrics.bridge.ledger import Ledger, slowdown_start
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.store import ActionStore, NewAlert
from tests.bridge_fakes import run_incident

T0 = 1767225600.0  # the alert reaches the bridge
FIRED = "2026-01-01T00:00:00Z"  # = T0: startsAt is when the alert fired
SCRAPE = 15.0
FAULT = T0 - 222.0  # rank 1 turns 1.48x slower here (mid scrape interval)


def counters(fault: float | None, *, start: float = T0 - 1800, end: float = T0,
             noise: float = 0.03, seed: int = 0) -> tuple[list[tuple[float, float]],
                                                           list[tuple[float, float]]]:
    """Scrapes of a rank's compute `_sum` and `_count`: 2 steps a second of 0.1 s compute,
    +-`noise` each, 1.48x from `fault` on."""
    rng = random.Random(seed)
    sums, counts, total, steps = [], [], 0.0, 0
    t = start
    while t <= end:
        sums.append((t, total))
        counts.append((t, float(steps)))
        for k in range(int(SCRAPE * 2)):
            at = t + k / 2
            total += 0.1 * (1.48 if fault is not None and at >= fault else 1.0) * (
                1 + rng.uniform(-noise, noise))
            steps += 1
        t += SCRAPE
    return sums, counts


@pytest.mark.parametrize("seed", range(5))
def test_the_rise_is_found_within_one_scrape_interval(seed: int) -> None:
    start = slowdown_start(*counters(FAULT, seed=seed))
    assert start is not None and FAULT - SCRAPE <= start <= FAULT + SCRAPE


def test_no_rise_no_start() -> None:
    assert slowdown_start(*counters(None)) is None  # healthy throughout
    assert slowdown_start(*counters(T0 - 1900)) is None  # slow since before the window
    sums, counts = counters(FAULT)
    assert slowdown_start(sums[:4], counts[:4]) is None  # too few scrapes
    assert slowdown_start([], []) is None


def test_idle_intervals_and_counter_resets_are_left_out() -> None:
    sums, counts = counters(FAULT)
    # a process restart an hour's third ago: its counters start again from 0
    cut = len(sums) // 3
    sums = [(t, v - sums[cut][1]) if i >= cut else (t, v) for i, (t, v) in enumerate(sums)]
    counts = [(t, v - counts[cut][1]) if i >= cut else (t, v) for i, (t, v) in enumerate(counts)]
    counts[cut + 3] = counts[cut + 2]  # and one interval with no step
    sums[cut + 3] = sums[cut + 2]
    start = slowdown_start(sums, counts)
    assert start is not None and FAULT - SCRAPE <= start <= FAULT + SCRAPE


class FakePrometheus:
    """Rank 1 of run r1 turned slow at FAULT; rank 0 never did. An older series of rank 1 (a
    process replaced before) is answered too, and must not be read."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, promql: str, at: float | None) -> list[dict[str, Any]]:
        self.queries.append(promql)
        assert at == T0 and promql.endswith("[1800s]"), promql
        assert promql.startswith('{__name__=~"robust_step_compute_seconds_(sum|count)", '
                                 'run="r1", rank="'), promql
        out = []
        fault = FAULT if 'rank="1"' in promql else None
        for pid, series in (("11", counters(fault)), ("7", counters(None, end=T0 - 1000))):
            for name, points in zip(("sum", "count"), series, strict=True):
                out.append({"metric": {"__name__": f"robust_step_compute_seconds_{name}",
                                       "run": "r1", "rank": promql.split('rank="')[1][0],
                                       "pid": pid},
                            "values": [[t, str(v)] for t, v in points]})
        return out


def _ledger(tmp_path: Path, rank: str, alertname: str = "SlowRank") -> tuple[Ledger, Any]:
    config = parse({"auth": {"bearer_token": "t"},
                    "schedulers": {"ops": {"type": "webhook", "url": "http://127.0.0.1:1"}},
                    "notify": {"url": "http://127.0.0.1:1"}, "incidents": {"poll": "1s"},
                    "rules": [{"name": "slow", "match": {"alertname": alertname},
                               "actions": [{"type": "notify", "message": "slow"}]}]})
    store = ActionStore(str(tmp_path / "log.db"))
    labels = {"alertname": alertname, "run": "r1", "rank": rank}
    run_incident(store, config, NewAlert("f1", FIRED, "r1", alertname, labels, {}, "slow", [], T0),
                 T0)
    prom = FakePrometheus()
    return Ledger(config, store, BridgeMetrics(), prom), prom


def test_a_slow_rank_is_detected_counting_from_the_rise_of_its_compute(tmp_path: Path) -> None:
    ledger, prom = _ledger(tmp_path, "1")
    (entry,) = ledger.step(now=T0 + 10)
    assert entry.alertname == "SlowRank" and entry.note == ""
    assert entry.fault is not None and FAULT - SCRAPE <= entry.fault <= FAULT + SCRAPE
    # detect time: from the rise to the bridge, not the alert's own 0 s from startsAt
    assert T0 - FAULT - SCRAPE <= entry.detect_s <= T0 - FAULT + SCRAPE
    assert len(prom.queries) == 1


def test_without_a_rise_the_fault_is_the_alerts_start_and_a_note_says_so(tmp_path: Path) -> None:
    ledger, _ = _ledger(tmp_path, "0")
    (entry,) = ledger.step(now=T0 + 10)
    assert entry.fault == T0 and entry.detect_s == 0.0
    assert "no rise of rank 0's compute" in entry.note


def test_other_alerts_keep_their_start(tmp_path: Path) -> None:
    ledger, prom = _ledger(tmp_path, "1", alertname="GPUThermalThrottle")
    (entry,) = ledger.step(now=T0 + 10)
    assert entry.fault == T0 and prom.queries == []
