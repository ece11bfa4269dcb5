"""The shipped rules mean the same on Prometheus and on VictoriaMetrics.

One recorded data set (tests/rules_replay.py: a healthy stretch, a slow rank, a NaN loss, spikes,
a checkpoint phase, an XID, a faulty GPU, a hung and stopped rank, a rank that exits) is
remote-written into a real Prometheus 2.42 and a real VictoriaMetrics 1.79; every recording rule
and alert is evaluated on both at the same instants (every 30 s), and the outputs are compared:

- every alert names the same culprits on both engines, and nothing fires on either while the run
  is healthy or checkpointing;
- at every instant, each rule's output series and firing alerts are the same on both engines, or
  the same as the other engine's one evaluation earlier or later (MetricsQL's `rate` and
  `increase` read the last sample before the window, so a value crossing a threshold, or a
  counter that stopped, can be seen one evaluation apart; docs/victoriametrics.md);
- recorded values agree within 5% (one sample of a 5 minute window at 15 s scrapes), with the
  same allowance of one evaluation; those computed from the windows the hook publishes (the
  straggler and slow-rank records) within 1e-6: both engines read the same numbers.

When a checkpoint begins, an alert that was firing may take one more evaluation to resolve: rule
groups are evaluated independently, so the straggler group can read the pause recorded by the
training group one evaluation late (in Prometheus as well, where groups run concurrently).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import pytest

from robust_metrics import rules
from tests import rules_replay as rr
from tests.prometheus_fixture import PrometheusServer
from tests.remote_write import push
from tests.victoriametrics_fixture import VictoriaMetricsServer

EVAL_S = 30
TOLERANCE = 0.05
# Records that are a rate themselves, or a difference of two, rather than a ratio of two rates
# over the same samples (where the window difference cancels): MetricsQL's rate() counts one more
# scrape interval of increase, and Prometheus divides a new series' increase by the whole window.
# (relative, absolute) tolerance; the absolute one is one 15 s scrape at 1 step/s over 5 minutes.
RATE_TOLERANCE = {"run:robust_steps:rate5m": (TOLERANCE, 0.05),
                  # FLOP/s and MFU are the step rate times FLOPs per step (and over the peak):
                  # the same 0.05 steps/s, on 8 ranks of 4e14 FLOPs a step, 989e12 peak each
                  "run:robust_model_flops:rate5m": (TOLERANCE, 0.05 * 8 * rr.FLOPS_PER_STEP),
                  **{name: (TOLERANCE, 0.05 * rr.FLOPS_PER_STEP / rr.PEAK_FLOPS)
                     for name in ("run:robust_mfu:ratio5m", "run:robust_mfu:train_ratio5m")},
                  # the median over an hour of those MFU values keeps the first windows'
                  # differences for the hour (8.5% at most in the 45 minutes replayed)
                  "run:robust_mfu:train_median1h": (0.1, 0.05 * rr.FLOPS_PER_STEP
                                                    / rr.PEAK_FLOPS)}
# A NaN sample: Prometheus stores it and the comparison drops the rank, VictoriaMetrics stores no
# value and reads the rank's sample before it, so at the NaN's instant the loss summaries of the
# run (8 ranks) differ by that rank on its own: a count of 7 against 8, the sum by one loss. The
# mean they make (run:robust_loss:mean) agrees within TOLERANCE.
RATE_TOLERANCE.update({name: (0.13, 0.0)
                       for name in ("robust_node_loss_sum", "robust_node_loss_count")})
# The straggler and slow-rank records read the windows the hook publishes (one value per rank,
# read with instant selectors), so both engines read the same numbers and must agree to the
# last digits (from rate() over the summaries they were up to 36% apart).
WINDOW_RECORDS = ("robust_step_compute_seconds:", "robust_step_blocked_seconds:",
                  "robust_step_duration_seconds:median", "robust_straggler_slowdown:",
                  "robust_steps:increase1m", "robust_step_ideal_seconds:")
WINDOW_TOLERANCE = 1e-6
NEW_SERIES_WINDOW_S = 5 * 60
# A median over an hour of such a rate holds the first window's difference until good values
# are the majority of its window: twice as long.
NEW_SERIES_SKIP_S = {"run:robust_mfu:train_median1h": 2 * NEW_SERIES_WINDOW_S}
# Records the replay's runs cannot produce, with why; both engines must record nothing for them
# (the promtool cases of alert_rules/tests/attribution_test.yml and whatif_st_test.yml cover them).
NOT_IN_REPLAY = {
    "run:robust_straggler_worst_stage:ratio5m":
        "recorded only with a stage verdict; the replay's slowdown is one DP rank's (worker)",
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    tmp = tmp_path_factory.mktemp("engines")
    # the data ends ten minutes ago: inside Prometheus' head, no sample in the future
    t0 = (int(time.time()) // 60 - rr.MINUTES - 10) * 60
    data = rr.scenario(t0)
    times = [t0 + 7.5 + EVAL_S * i for i in range(rr.MINUTES * 60 // EVAL_S)]
    groups = rules.load_groups()
    with PrometheusServer(tmp / "prometheus",
                          extra_args=["--web.enable-remote-write-receiver"]) as prom, \
            VictoriaMetricsServer(tmp / "vm") as vm, httpx.Client() as client:
        push(client, f"{prom.url}/api/v1/write", data)
        push(client, f"{vm.url}/api/v1/write", data)
        vm.force_flush()
        yield {"t0": t0, "times": times,
               "prometheus": rr.Replay(prom.url, groups).run(times),
               "victoriametrics": rr.Replay(vm.url, groups,
                                            flush_url=f"{vm.url}/internal/force_flush").run(times)}


def _firing(trace: rr.Trace, at: float, alert: str) -> set[str | None]:
    return {dict(k).get("rank") for k in trace.alerts.get((at, alert), set())}


def _minutes(t0: float, at: float) -> float:
    return (at - t0) / 60


@pytest.mark.parametrize("engine", ["prometheus", "victoriametrics"])
def test_each_fault_names_its_culprit_and_nothing_else_fires(traces: dict[str, object],
                                                               engine: str) -> None:
    trace: rr.Trace = traces[engine]  # type: ignore[assignment]
    t0: float = traces["t0"]  # type: ignore[assignment]
    assert not trace.errors, trace.errors
    seen: dict[str, set[str | None]] = {}
    for (at, alert), firing in trace.alerts.items():
        minute = _minutes(t0, at)
        pausing = (rr.CKPT[0] + EVAL_S) / 60 <= minute < rr.CKPT[1] / 60 + 1
        if firing and (minute < rr.SLOW_FROM / 60 or pausing):
            raise AssertionError(f"{engine}: {alert} fired at minute {minute:.1f}: {firing}")
        for key in firing:
            seen.setdefault(alert, set()).add(dict(key).get("rank"))
    assert seen.pop("SlowRank") == {str(rr.SLOW_RANK)}
    assert seen.pop("NonFiniteLoss") == {str(rr.NAN_RANK)}
    assert seen.pop("NonFiniteGradients") == {None}
    assert seen.pop("GPUXidCritical") == {str(rr.XID_RANK)}
    for alert in ("GPUEccUncorrectable", "GPURowRemapFailure", "GPUThermalThrottle", "GPULost"):
        assert seen.pop(alert) == {str(rr.GPU_FAULT_RANK)}, alert
    assert seen.pop("RankHang") == {str(rr.HUNG_RANK)}
    assert seen.pop("RankExited") == {str(rr.EXIT_RANK)}
    assert seen.pop("LossSpike") == {None}
    assert seen.pop("GradNormSpike") == {None}
    assert seen.pop("TrainingHang") == {None}
    assert seen.pop("StragglerSlowdownHigh") == {str(rr.SLOW_RANK)}
    assert not seen, f"{engine}: unexpected alerts {seen}"


def _agree_within_one_evaluation(prom: dict[float, object], vm: dict[float, object],
                                 times: list[float]) -> list[float]:
    """Instants where Prometheus' output matches VictoriaMetrics' neither then nor one
    evaluation before or after."""
    bad = []
    for i, at in enumerate(times):
        near = [vm.get(times[j]) for j in (i - 1, i, i + 1) if 0 <= j < len(times)]
        if prom.get(at) not in near:
            bad.append(at)
    return bad


def test_alerts_fire_for_the_same_series_on_both_engines(traces: dict[str, object]) -> None:
    prom: rr.Trace = traces["prometheus"]  # type: ignore[assignment]
    vm: rr.Trace = traces["victoriametrics"]  # type: ignore[assignment]
    times: list[float] = traces["times"]  # type: ignore[assignment]
    t0: float = traces["t0"]  # type: ignore[assignment]
    differ = {}
    for alert in {name for _, name in prom.alerts}:
        series_p = {at: frozenset(prom.alerts[(at, alert)]) for at in times}
        series_v = {at: frozenset(vm.alerts[(at, alert)]) for at in times}
        bad = _agree_within_one_evaluation(series_p, series_v, times)
        if bad:
            differ[alert] = [round(_minutes(t0, at), 1) for at in bad]
    assert not differ, f"firing sets differ (minutes): {differ}"


def _excess(a: float, b: float, absolute: float) -> float:
    """By how much |a - b| exceeds the absolute tolerance, relative to the larger value."""
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return max(abs(a - b) - absolute, 0.0) / max(abs(a), abs(b), 1e-9)


def test_recording_rules_agree(traces: dict[str, object]) -> None:
    prom: rr.Trace = traces["prometheus"]  # type: ignore[assignment]
    vm: rr.Trace = traces["victoriametrics"]  # type: ignore[assignment]
    times: list[float] = traces["times"]  # type: ignore[assignment]
    t0: float = traces["t0"]  # type: ignore[assignment]
    label_sets, values, report = {}, {}, {}
    for record in {name for _, name in prom.records}:
        keys_p = {at: frozenset(prom.records[(at, record)]) for at in times}
        keys_v = {at: frozenset(vm.records[(at, record)]) for at in times}
        bad = _agree_within_one_evaluation(keys_p, keys_v, times)
        if bad:
            label_sets[record] = [round(_minutes(t0, at), 1) for at in bad]
        if record in NOT_IN_REPLAY:
            assert not any(keys_p.values()) and not any(keys_v.values()), record
            continue
        assert any(keys_p.values()), f"{record} recorded nothing: the comparison proves nothing"
        worst, where = 0.0, None
        relative, absolute = RATE_TOLERANCE.get(record, (TOLERANCE, 0.0))
        if any(part in record for part in WINDOW_RECORDS):
            relative = WINDOW_TOLERANCE
        for i, at in enumerate(times):
            if record in RATE_TOLERANCE and at - t0 < NEW_SERIES_SKIP_S.get(
                    record, NEW_SERIES_WINDOW_S):
                continue
            near = [vm.records[(times[j], record)] for j in (i, i - 1, i + 1)
                    if 0 <= j < len(times)]
            for key, a in prom.records[(at, record)].items():
                diffs = [_excess(a, out[key], absolute) for out in near if key in out]
                if min(diffs, default=0.0) > worst:
                    worst, where = min(diffs, default=0.0), (round(_minutes(t0, at), 1), key)
        report[record] = worst
        if worst > relative:
            values[record] = (round(worst, 3), where)
    print("\n" + "\n".join(f"{name}: max relative difference {diff:.3g}"
                           for name, diff in sorted(report.items())))
    assert not label_sets, f"output series differ (minutes): {label_sets}"
    assert not values, f"values differ by more than their tolerance: {values}"
