"""Per-node summaries of the ranks' series: the sidecar's and the rule group's are the same.

The run-level rules read `robust_node_*` summaries, which the sidecar's `node_summaries` and
`process` collectors publish per node, or, without a sidecar, the rule group
`robust-node-summaries` records from every rank's series. Both must give the rules the same
numbers, so a test evaluates the rule group in promtool against the collectors' own
computation of the same ranks, for every series they publish.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from robust_metrics import node_summary_rules, rules, schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink
from robust_metrics.sidecar.collectors.node_summaries import (
    PROCESS_SUMMARIES,
    SUMMARIES,
    NodeSummariesCollector,
    RankValue,
    quantile,
    summarise,
)
from robust_metrics.sidecar.collectors.process import ProcessCollector
from robust_metrics.sidecar.collectors.ranks import RanksCollector
from robust_metrics.sidecar.collectors.registry import ScrapeRegistry
from robust_metrics.sidecar.rank_files import RankFiles
from tests.support import require_binary

COMPUTE = schema.STEP_COMPUTE_MEAN.name
DURATION = schema.STEP_DURATION_MEAN.name

# five ranks of run "p": stages 0 and 1 of a pipeline, rank 4 without a topology yet
STAGES = {("p", "0"): "0", ("p", "1"): "0", ("p", "2"): "1", ("p", "3"): "1"}
WINDOWS = {  # rank -> (compute, duration, variation, steps), the same in every window
    "0": (0.5, 1.0, 0.125, 60.0),
    "1": (0.75, 1.0, 0.25, 60.0),
    "2": (0.625, 1.0, 0.0625, 59.0),
    "3": (1.5, 1.0, 0.5, 60.0),  # computes longer than its step (clock skew): blocked is 0
    "4": (0.25, 0.75, 0.125, 61.0),
}
PROGRESS = {  # rank -> (global step, steps, entered per group, loss, grad norm, checkpoint, age)
    "0": (120.0, 100.0, (300.0, 20.0), 2.5, 1.0, 1000.0, 4.0),
    "1": (121.0, 101.0, (303.0, 21.0), 2.25, 8.0, 0.0, 2.0),
    "2": (121.0, 90.0, (303.0, 0.0), math.nan, 1.5, 1100.0, 6.0),
    "3": (119.0, 100.0, (297.0, 19.0), 3.0, math.inf, 1200.0, 3.0),
    "4": (120.0, 30.0, (300.0, 20.0), 2.0, 2.0, 1050.0, 5.0),
}
PHASES = {"3": "checkpoint"}  # the others train


def rank_samples() -> list[RankValue]:
    """Every rank series a summary reads, of the five ranks (those the process collector
    computes included, as a rank's in-process exporter serves its step age)."""
    out = []
    for rank, (compute, duration, variation, steps) in WINDOWS.items():
        for window in ("1m", "2m", "5m"):
            out.append(RankValue("p", rank, COMPUTE, window, compute))
        for window in ("2m", "5m"):
            out.append(RankValue("p", rank, DURATION, window, duration))
        out.append(RankValue("p", rank, schema.STEP_COMPUTE_VARIATION.name, "1m", variation))
        out.append(RankValue("p", rank, schema.WINDOW_STEPS.name, "1m", steps))
    for rank, (step, done, entered, loss, grad, saved, age) in PROGRESS.items():
        out += [RankValue("p", rank, schema.GLOBAL_STEP.name, "", step),
                RankValue("p", rank, schema.STEPS_TOTAL.name, "", done),
                RankValue("p", rank, schema.LOSS.name, "", loss),
                RankValue("p", rank, schema.GRAD_NORM.name, "", grad),
                RankValue("p", rank, schema.LAST_CHECKPOINT_TIMESTAMP.name, "", saved),
                RankValue("p", rank, schema.LAST_STEP_TIMESTAMP.name, "", 2000.0 + step),
                RankValue("p", rank, schema.RANK_STEP_AGE.name, "", age)]
        out += [RankValue("p", rank, schema.COLLECTIVES_ENTERED.name, "", n) for n in entered]
        out += [RankValue("p", rank, schema.NONFINITE_GRAD.name, "", float(rank == "1")),
                RankValue("p", rank, schema.SKIPPED_STEPS.name, "", done / 10)]
        for phase in schema.PHASES:
            out.append(RankValue("p", rank, schema.PHASE.name, phase,
                                 float(PHASES.get(rank, "train") == phase)))
    return out


def rank_series(values: list[RankValue]) -> list[dict[str, str]]:
    """The samples as promtool input series (a rank's collective counts one per group)."""
    series = []
    groups: dict[tuple[str, str], int] = {}
    for v in values:
        labels = {"run": v.run, "rank": v.rank}
        key = next((s.key for s in (*SUMMARIES, *PROCESS_SUMMARIES)
                    if s.source == v.metric and s.key), "window" if v.key else "")
        if key:
            labels[key] = v.key
        if v.metric == schema.COLLECTIVES_ENTERED.name:
            labels["group"] = f"g{groups.setdefault((v.run, v.rank), 0)}"
            groups[(v.run, v.rank)] += 1
        text = ",".join(f'{k}="{x}"' for k, x in labels.items())
        value = "NaN" if math.isnan(v.value) else ("+Inf" if v.value == math.inf else v.value)
        series.append({"series": f"{v.metric}{{{text}}}", "values": " ".join([str(value)] * 5)})
    return series


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
    values = [
        *rank_samples(),
        RankValue("p", "5", COMPUTE, "1m", 0.0),  # no compute timing yet: not a rank of 0 s
        RankValue("p", "6", COMPUTE, "1m", math.nan),
        RankValue("q", "0", COMPUTE, "1m", 2.0),  # another run on the same node
    ]
    got = samples(summarise(values, "n1", STAGES))
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


def test_a_nodes_progress_adds_up_its_ranks_and_skips_non_finite_values() -> None:
    got = samples(summarise(rank_samples(), "n1", STAGES))
    run = (("node", "n1"), ("run", "p"))
    assert got[(schema.NODE_COLLECTIVES_ENTERED.name + "_sum", run)] == 1583  # every group
    assert got[(schema.NODE_STEPS.name + "_count", run)] == 5
    assert got[(schema.NODE_LOSS.name + "_count", run)] == 4  # rank 2's NaN left out
    greatest = (("node", "n1"), ("quantile", "1"), ("run", "p"))
    assert got[(schema.NODE_GRAD_NORM.name, greatest)] == 8.0  # not +Inf
    train = (("node", "n1"), ("phase", "train"), ("quantile", "0"), ("run", "p"))
    assert got[(schema.NODE_PHASE.name, train)] == 0.0  # rank 3 is in a checkpoint
    assert got[(schema.NODE_LAST_CHECKPOINT_TIMESTAMP.name, greatest)] == 1200


def test_the_summaries_name_only_declared_series() -> None:
    declared = schema.sample_names()
    for family in summarise(rank_samples(), "n1", STAGES,
                            (*SUMMARIES, *PROCESS_SUMMARIES)):
        for s in family.samples:
            spec = declared[s.name]
            assert spec.source is schema.Source.SIDECAR
            assert set(s.labels) <= set(spec.labels), s
            assert {"run", "node"} <= set(s.labels), s


def test_the_collector_serves_the_summaries_of_the_ranks_in_the_folder(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    for pid, rank in ((301, "0"), (302, "2")):
        store = MetricStore({"run": "p", "rank": rank})
        for window in ("1m", "2m", "5m"):
            store.series(schema.STEP_COMPUTE_MEAN, window=window).set(WINDOWS[rank][0])
        store.series(schema.STEPS_TOTAL).inc(PROGRESS[rank][1])
        MultiprocessSink(str(tmp_path), pid=pid).flush(store)
        (tmp_path / "ranks" / f"{pid}.json").write_text(json.dumps(
            {"run": "p", "rank": rank, "pid": pid,
             "topology": {"pp_rank": int(STAGES[("p", rank)])}, "started": time.time()}))
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: pid in (301, 302),
                       cache_seconds=0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeRegistry({"node_summaries": NodeSummariesCollector(folder, "n1")},
                                     node="n1"))
    name = schema.NODE_STEP_COMPUTE_MEAN.name
    for rank in ("0", "2"):
        labels = {"run": "p", "node": "n1", "pp_rank": STAGES[("p", rank)], "window": "5m"}
        assert registry.get_sample_value(name, {**labels, "quantile": "1"}) == WINDOWS[rank][0]
        assert registry.get_sample_value(name + "_count", labels) == 1
    steps = schema.NODE_STEPS.name
    assert registry.get_sample_value(f"{steps}_sum", {"run": "p", "node": "n1"}) == 190
    folder.close()


def test_the_sidecar_serves_no_window_that_only_the_summaries_read(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    store = MetricStore({"run": "p", "rank": "0"})
    for window in ("1m", "2m", "5m"):
        store.series(schema.STEP_COMPUTE_MEAN, window=window).set(0.5)
    MultiprocessSink(str(tmp_path), pid=303).flush(store)
    (tmp_path / "ranks" / "303.json").write_text(json.dumps(
        {"run": "p", "rank": "0", "pid": 303, "started": time.time()}))
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: pid == 303, cache_seconds=0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeRegistry({"ranks": RanksCollector(folder),
                                      "node_summaries": NodeSummariesCollector(folder, "n1")},
                                     node="n1"))
    served = {s.labels["window"] for m in registry.collect() for s in m.samples
              if s.name == COMPUTE}
    assert served == {"1m", "5m"}  # 2m: only its node summary is served
    count = registry.get_sample_value(schema.NODE_STEP_COMPUTE_MEAN.name + "_count",
                                      {"run": "p", "node": "n1", "window": "2m"})
    assert count == 1
    assert folder.snapshot().families  # the shared snapshot keeps every window for the others
    assert {s.labels["window"] for f in folder.snapshot().families for s in f.samples
            if s.name == COMPUTE} == {"1m", "2m", "5m"}
    folder.close()


def test_the_process_collector_summarises_the_ages_it_publishes(tmp_path: Path) -> None:
    """The least step age of the node's live ranks that have not finished, and whether any
    rank process lives: this process plays rank 0, a pid that is gone rank 1."""
    (tmp_path / "ranks").mkdir()
    now = time.time()
    for pid, rank in ((os.getpid(), "0"), (2**22 + 11, "1")):
        store = MetricStore({"run": "p", "rank": rank})
        store.series(schema.LAST_STEP_TIMESTAMP).set(now - 30)
        MultiprocessSink(str(tmp_path), pid=pid).flush(store)
        (tmp_path / "ranks" / f"{pid}.json").write_text(json.dumps(
            {"run": "p", "rank": rank, "pid": pid, "started": now - 60}))
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: pid == os.getpid(),
                       cache_seconds=0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeRegistry({"process": ProcessCollector(folder, node="n1")},
                                     node="n1"))
    node = {"run": "p", "node": "n1"}
    age = registry.get_sample_value(schema.NODE_RANK_STEP_AGE.name, {**node, "quantile": "0"})
    assert age is not None and 29 <= age <= 40
    alive = schema.NODE_RANK_PROCESS_ALIVE.name
    assert registry.get_sample_value(alive, {**node, "quantile": "1"}) == 1
    assert registry.get_sample_value(f"{alive}_count", node) == 2
    folder.close()


def test_the_committed_rule_group_is_the_generated_one() -> None:
    assert node_summary_rules.PATH.read_text() == node_summary_rules.render(), (
        "alert_rules/node_summaries.yml is stale: run `python -m robust_metrics.node_summary_rules`")


def test_the_rule_group_records_what_the_sidecar_publishes(tmp_path: Path) -> None:
    """Without a sidecar the rules record the summaries from the ranks' own series: the same
    values, all of a run's ranks (of a stage) as one node (no node label)."""
    promtool = require_binary("promtool")
    values = rank_samples()
    series = rank_series(values)
    for (run, rank), stage in STAGES.items():
        series.append({"series": f'robust_rank_info{{run="{run}",rank="{rank}",node="n1",'
                                 f'pp_rank="{stage}"}}', "values": "1x4"})
    expected: dict[str, list[dict[str, object]]] = {}
    for family in summarise(values, "", STAGES, (*SUMMARIES, *PROCESS_SUMMARIES)):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "node"}
            expected.setdefault(s.name, []).append({"labels": _selector(s.name, labels),
                                                    "value": s.value})
    published = {f"{s.spec.name}{suffix}" for s in (*SUMMARIES, *PROCESS_SUMMARIES)
                 for suffix in ("", "_sum", "_count")}
    recorded = {r["record"] for g in rules.load_groups() if g["name"] == rules.NODE_SUMMARY_GROUP
                for r in g["rules"]}
    assert set(expected) == recorded - {schema.NODE_RANK_PROCESS_ALIVE.name,
                                        schema.NODE_RANK_PROCESS_ALIVE.name + "_count"}
    assert recorded <= published
    tests = [{"interval": "15s", "input_series": series, "promql_expr_test": [
        {"expr": name, "eval_time": "45s", "exp_samples": exp} for name, exp in expected.items()]}]
    test_file = tmp_path / "node_summaries_test.yml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(node_summary_rules.PATH)], "evaluation_interval": "15s",
        "tests": tests}))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rule_group_skips_runs_that_a_sidecar_serves(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    count = schema.NODE_STEP_COMPUTE_MEAN.name + "_count"
    alive = schema.NODE_RANK_PROCESS_ALIVE.name + "_count"
    test_file = tmp_path / "skip_test.yml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(node_summary_rules.PATH)], "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": [
            {"series": f'{COMPUTE}{{run="p",rank="0",window="1m"}}', "values": "0.5x4"},
            {"series": f'{COMPUTE}{{run="q",rank="0",window="1m"}}', "values": "0.5x4"},
            {"series": f'{alive}{{run="p",node="n1"}}', "values": "1x4"},
        ], "promql_expr_test": [
            {"expr": f'{count}{{node=""}}', "eval_time": "45s", "exp_samples": [
                {"labels": f'{count}{{run="q",window="1m"}}', "value": 1}]}]}]}))
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
