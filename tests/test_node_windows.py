"""Per-node summaries of the ranks' step windows: the sidecar's and the rule group's are the same.

The run-level straggler rules read `robust_node_*` summaries, which the sidecar's `node_windows`
collector publishes per node and stage, or, without a sidecar, the rule group
`robust-node-summaries` records from every rank's series. Both must give the rules the same
numbers, so the second test evaluates the rule group in promtool against the collector's own
computation of the same ranks.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from robust_metrics import rules, schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink
from robust_metrics.sidecar.collectors.node_windows import (
    SUMMARIES,
    NodeWindowsCollector,
    RankWindow,
    quantile,
    summarise,
)
from robust_metrics.sidecar.collectors.registry import ScrapeRegistry
from robust_metrics.sidecar.rank_files import RankFiles
from tests.support import require_binary

COMPUTE = schema.STEP_COMPUTE_MEAN.name
DURATION = schema.STEP_DURATION_MEAN.name

# five ranks of run "p": stages 0 and 1 of a pipeline, rank 4 without a topology yet
STAGES = {("p", "0"): "0", ("p", "1"): "0", ("p", "2"): "1", ("p", "3"): "1"}
VALUES = {  # rank -> (compute, duration, variation, steps), the same in every window
    "0": (0.5, 1.0, 0.125, 60.0),
    "1": (0.75, 1.0, 0.25, 60.0),
    "2": (0.625, 1.0, 0.0625, 59.0),
    "3": (1.5, 1.0, 0.5, 60.0),  # computes longer than its step (clock skew): blocked is 0
    "4": (0.25, 0.75, 0.125, 61.0),
}


def rank_windows() -> list[RankWindow]:
    windows = []
    for rank, (compute, duration, variation, steps) in VALUES.items():
        for window in ("1m", "2m", "5m"):
            windows.append(RankWindow("p", rank, COMPUTE, window, compute))
        for window in ("2m", "5m"):
            windows.append(RankWindow("p", rank, DURATION, window, duration))
        windows.append(RankWindow("p", rank, schema.STEP_COMPUTE_VARIATION.name, "1m", variation))
        windows.append(RankWindow("p", rank, schema.WINDOW_STEPS.name, "1m", steps))
    return windows


def samples(families: list) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families for s in f.samples}


def test_quantile_interpolates_as_promql_does() -> None:
    assert quantile([1.0, 2.0, 3.0, 10.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 10.0], 0.0) == 1.0
    assert quantile([1.0, 2.0, 3.0, 10.0], 1.0) == 10.0
    assert quantile([4.0], 0.5) == 4.0
    assert quantile([1.0, 2.0, 3.0], 0.25) == 1.5


def test_a_nodes_summaries_leave_out_ranks_without_timing_and_split_stages() -> None:
    windows = [
        *rank_windows(),
        RankWindow("p", "5", COMPUTE, "1m", 0.0),  # no compute timing yet: not a rank of 0 s
        RankWindow("p", "6", COMPUTE, "1m", math.nan),
        RankWindow("q", "0", COMPUTE, "1m", 2.0),  # another run on the same node
    ]
    got = samples(summarise(windows, "n1", STAGES))
    stage0 = (("node", "n1"), ("pp_rank", "0"), ("run", "p"), ("window", "1m"))
    no_stage = (("node", "n1"), ("run", "p"), ("window", "1m"))
    name = schema.NODE_STEP_COMPUTE_MEAN.name
    assert got[(name, (*stage0[:2], ("quantile", "0.5"), *stage0[2:]))] == 0.625
    assert got[(name + "_count", stage0)] == 2
    assert got[(name + "_count", no_stage)] == 1  # rank 4; ranks 5 and 6 left out
    assert got[(name + "_count", (("node", "n1"), ("run", "q"), ("window", "1m")))] == 1
    blocked = schema.NODE_STEP_BLOCKED_MEAN.name
    stage1_2m = (("node", "n1"), ("pp_rank", "1"), ("quantile", "0"), ("run", "p"),
                 ("window", "2m"))
    assert got[(blocked, stage1_2m)] == 0.0  # rank 3's negative wait counts as none


def test_the_summaries_name_only_declared_series() -> None:
    declared = schema.sample_names()
    for family in summarise(rank_windows(), "n1", STAGES):
        for s in family.samples:
            spec = declared[s.name]
            assert spec.source is schema.Source.SIDECAR
            assert set(s.labels) <= set(spec.labels), s
            assert {"run", "node", "window"} <= set(s.labels), s


def test_the_collector_serves_the_summaries_of_the_ranks_in_the_folder(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    for pid, rank in ((301, "0"), (302, "2")):
        store = MetricStore({"run": "p", "rank": rank})
        compute = VALUES[rank][0]
        for window in ("1m", "2m", "5m"):
            store.series(schema.STEP_COMPUTE_MEAN, window=window).set(compute)
        MultiprocessSink(str(tmp_path), pid=pid).flush(store)
        (tmp_path / "ranks" / f"{pid}.json").write_text(json.dumps(
            {"run": "p", "rank": rank, "pid": pid, "topology": {"pp_rank": int(STAGES[("p", rank)])},
             "started": time.time()}))
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: pid in (301, 302),
                       cache_seconds=0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeRegistry({"node_windows": NodeWindowsCollector(folder, "n1")},
                                     node="n1"))
    name = schema.NODE_STEP_COMPUTE_MEAN.name
    for rank in ("0", "2"):
        labels = {"run": "p", "node": "n1", "pp_rank": STAGES[("p", rank)], "window": "5m"}
        assert registry.get_sample_value(name, {**labels, "quantile": "1"}) == VALUES[rank][0]
        assert registry.get_sample_value(name + "_count", labels) == 1
    folder.close()


def test_the_rule_group_records_what_the_sidecar_publishes(tmp_path: Path) -> None:
    """Without a sidecar the rules record the summaries from the ranks' own series: the same
    values, all of a run's ranks of a stage as one node (no node label)."""
    promtool = require_binary("promtool")
    series = []
    for w in rank_windows():
        labels = f'run="{w.run}",rank="{w.rank}",window="{w.window}"'
        series.append({"series": f"{w.metric}{{{labels}}}", "values": f"{w.value}x4"})
    for (run, rank), stage in STAGES.items():
        series.append({"series": f'robust_rank_info{{run="{run}",rank="{rank}",node="n1",'
                                 f'pp_rank="{stage}"}}', "values": "1x4"})
    expected: dict[str, list[dict[str, object]]] = {}
    for family in summarise(rank_windows(), "", STAGES):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "node"}
            expected.setdefault(s.name, []).append({"labels": _selector(s.name, labels),
                                                    "value": s.value})
    published = {f"{s.spec.name}{suffix}" for s in SUMMARIES for suffix in ("", "_sum", "_count")}
    assert set(expected) <= published and len(expected) == 5 + 2  # every family, sum, count
    tests = [{"interval": "15s", "input_series": series, "promql_expr_test": [
        {"expr": name, "eval_time": "45s", "exp_samples": exp} for name, exp in expected.items()]}]
    test_file = tmp_path / "node_summaries_test.yml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(rules.RULES_DIR / "node_summaries.yml")],
        "evaluation_interval": "15s",
        "tests": tests}))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rule_group_skips_runs_whose_sidecars_publish_summaries(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    count = schema.NODE_STEP_COMPUTE_MEAN.name + "_count"
    test_file = tmp_path / "skip_test.yml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(rules.RULES_DIR / "node_summaries.yml")],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": [
            {"series": f'{COMPUTE}{{run="p",rank="0",window="1m"}}', "values": "0.5x4"},
            {"series": f'{count}{{run="p",node="n1",window="1m"}}', "values": "1x4"},
        ], "promql_expr_test": [
            {"expr": f'{count}{{node=""}}', "eval_time": "45s", "exp_samples": []}]}]}))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rendering_for_sidecars_leaves_the_rank_level_group_out() -> None:
    names = {g["name"] for g in rules.load_groups(node_summaries="sidecar")}
    assert rules.NODE_SUMMARY_GROUP not in names
    assert rules.NODE_SUMMARY_GROUP in {g["name"] for g in rules.load_groups()}


def _selector(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"
