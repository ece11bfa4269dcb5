"""The schema is the one source of metric names; docs/metrics.md is generated from it."""

from __future__ import annotations

import re

import pytest

from robust_metrics import schema

CORE = [
    "robust_steps_total", "robust_last_step_timestamp_seconds", "robust_step_duration_seconds",
    "robust_step_compute_seconds", "robust_collective_duration_seconds", "robust_loss",
    "robust_grad_norm", "robust_nonfinite_loss_steps_total", "robust_nonfinite_grad_steps_total",
    "robust_rank_info",
]


@pytest.mark.parametrize("name", CORE)
def test_core_metrics_keep_their_names_and_rank_labels(name: str) -> None:
    spec = schema.get(name)
    assert spec.labels[:2] == ("run", "rank")
    assert spec.source is schema.Source.RANK


def test_collective_duration_is_keyed_by_op_and_group() -> None:
    assert schema.get("robust_collective_duration_seconds").labels == ("run", "rank", "op", "group")


def test_names_follow_prometheus_conventions() -> None:
    for m in schema.all_metrics():
        assert re.fullmatch(r"robust_[a-z0-9_]+", m.name), m.name
        assert m.help.strip() and not m.help[0].islower(), m.name
        assert m.help.rstrip().endswith("."), m.name
        assert "job" not in m.labels, f"{m.name}: the `job` label belongs to Prometheus"
        if m.type is schema.MetricType.COUNTER:
            assert m.name.endswith("_total"), m.name
        else:
            assert not m.name.endswith("_total"), m.name
        if m.unit:
            assert m.name.removesuffix("_total").endswith(m.unit), (m.name, m.unit)
        for bad in ("_ms", "_milliseconds", "_kb", "_mb", "_percent"):
            assert bad not in m.name, m.name


def test_per_rank_series_carry_only_run_and_rank_plus_bounded_keys() -> None:
    allowed_extra = {"op", "group", "phase", "where", "window"}  # window: 1m, 2m, 5m at most
    for m in schema.all_metrics(schema.Source.RANK):
        if m.name == "robust_rank_info":
            continue
        assert m.labels[:2] == ("run", "rank"), m.name
        assert set(m.labels[2:]) <= allowed_extra, m.name


def test_unknown_metric_is_named_in_the_error() -> None:
    with pytest.raises(KeyError, match="robust_nope"):
        schema.get("robust_nope")
