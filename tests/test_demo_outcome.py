"""The demo's verdict and report without running it: exit status, summary table, failed queries.

`problems()` decides the exit status from what the fault script recorded; `write_report` runs
against a stack whose Prometheus and bridge do not answer, which must be reported as errors and
never as "no alerts". The full demo runs in tests/integration/test_demo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from robust_metrics.demo.report import SUMMARY_HEADER, alerts_fired, summary_table, write_report
from robust_metrics.demo.scenario import FAULTS, FaultRecord, problems
from robust_metrics.demo.stack import DemoStack
from robust_metrics.processes import Prometheus, ServiceError
from tests.support import require_binary

SLOW, NAN, HANG = FAULTS


def _kept(fault: object, *, actions: tuple[str, ...] = (), result: str = "") -> FaultRecord:
    f = fault  # type: ignore[assignment]
    record = FaultRecord(f, 1000.0, 1005.0, str(f.rank), list(actions))  # type: ignore[attr-defined]
    record.result = result or ("acted" if f.action else "detected")  # type: ignore[attr-defined]
    return record


def _all_kept() -> list[FaultRecord]:
    return [_kept(SLOW, actions=("checkpoint:success",)), _kept(NAN),
            _kept(HANG, actions=("dump_stacks:success", "restart:success"))]


def test_a_run_that_keeps_every_promise_has_no_problems() -> None:
    assert problems(_all_kept(), resumed_from=40) == []
    assert problems([], resumed_from=None, healthy_alerts=[]) == []


def test_detection_alone_is_not_success() -> None:
    records = _all_kept()
    records[0].result, records[0].actions = "action failed", ["checkpoint:failed"]
    assert problems(records, resumed_from=40) == [
        "slow rank: the bridge's checkpoint ended as 'action failed' (checkpoint:failed)"]
    records = _all_kept()
    records[2].result, records[2].actions = "no action", []
    assert problems(records, resumed_from=40) == [
        "hung rank: the bridge's restart ended as 'no action' (no steps)"]


def test_a_restart_without_resume_fails_the_run() -> None:
    assert problems(_all_kept(), resumed_from=None) == [
        "the job did not resume from its checkpoint after the restart"]


def test_missed_and_misattributed_faults_fail_the_run() -> None:
    records = _all_kept()
    records[1] = FaultRecord(NAN, 1000.0)  # never detected
    records[0].alert_rank = "1"
    assert problems(records, resumed_from=40) == [
        "slow rank: SlowRank named rank 1, not rank 2", "NaN loss: NonFiniteLoss did not fire"]


def test_an_alert_on_a_healthy_run_fails_it() -> None:
    assert problems([], resumed_from=None, healthy_alerts=["SlowRank"]) == [
        "SlowRank fired on a run without faults"]


def test_the_summary_table_starts_with_its_header_row() -> None:
    lines = summary_table(_all_kept()).splitlines()
    assert lines[0].split() == list(SUMMARY_HEADER)
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert [line.split()[0] for line in lines[2:]] == ["slow", "NaN", "hung"]
    assert summary_table([]).splitlines()[0].split() == list(SUMMARY_HEADER)


@pytest.fixture
def dead_stack(tmp_path: Path) -> DemoStack:
    """A demo stack whose Prometheus and bridge are not running (their ports are closed)."""
    require_binary("prometheus")
    stack = DemoStack(tmp_path / "run", ranks=2)
    stack.prometheus = Prometheus(tmp_path / "prom", port=stack.ports["prometheus"])
    return stack


def test_a_failed_alerts_query_raises_instead_of_meaning_no_alerts(dead_stack: DemoStack) -> None:
    with pytest.raises(ServiceError, match="unreachable"):
        alerts_fired(dead_stack, 1000.0, 1100.0)


def test_the_report_lists_failed_queries_as_errors(dead_stack: DemoStack, tmp_path: Path) -> None:
    report = write_report(dead_stack, _all_kept(), 1000.0, 1100.0, tmp_path / "report", 40)
    assert report.alerts_fired is None
    assert any(e.startswith("the query for the alerts that fired failed") for e in report.errors)
    assert any(e.startswith("could not read the bridge's actions") for e in report.errors)
    assert any("robust_step_duration_seconds" in e for e in report.errors)  # a plot's query
    document = json.loads((tmp_path / "report" / "report.json").read_text())
    assert document["alerts_fired"] is None and document["errors"] == report.errors
    page = report.page.read_text()
    assert "## Errors" in page and "This report is incomplete" in page
