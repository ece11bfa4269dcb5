"""`robust-metrics rules --rank-shards N`: the rank-by-rank rules split over N groups of ranks.

What a user relies on: the sharded rules judge exactly as the unsharded ones (every promtool unit
test passes against them), every rank lands in exactly one shard, and only per-rank selectors are
restricted (a join against a run's median or a node's GPU peak still finds it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from robust_metrics import rule_shards, rules
from tests.support import ROOT, require_binary

RULES = ROOT / "alert_rules"


def rules_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robust_metrics.cli", "rules", *args],
                          capture_output=True, text=True, timeout=60)


def _render_sharded_sources(into: Path, shards: int) -> dict[str, list[str]]:
    """Each rule source file sharded into `into`, under its own name; its group order."""
    order = {}
    for path in rules.rule_files(RULES):
        groups = rule_shards.shard_by_rank(yaml.safe_load(path.read_text())["groups"], shards)
        order[path.name] = [g["name"] for g in groups]
        (into / path.name).write_text(rules.render(groups))
    return order


def test_sharded_rules_pass_every_promtool_unit_test(tmp_path: Path) -> None:
    """The unit tests, unchanged, against rules in 3 rank shards (the cases' ranks then fall in
    every shard, several in some, none in others; which rank goes where is tested for 2-100
    shards below). Groups are evaluated in file order (shards before the run-level rules that
    read them), as promtool does when told an order; in a live Prometheus that read may be one
    evaluation older."""
    shards = 3
    promtool = require_binary("promtool")
    order = _render_sharded_sources(tmp_path, shards)
    shutil.copytree(RULES / "tests", tmp_path / "tests")
    tests = sorted((tmp_path / "tests").glob("*_test.yml"))
    for test in tests:
        spec = yaml.safe_load(test.read_text())
        spec["group_eval_order"] = [g for f in spec["rule_files"] for g in order[Path(f).name]]
        test.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", *[t.name for t in tests]],
                            cwd=tmp_path / "tests", capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.parametrize("shards", [2, 3, 8, 10, 64, 100])
def test_every_rank_is_in_exactly_one_shard(shards: int) -> None:
    patterns = [re.compile(f"(?:{rule_shards.rank_regex(k, shards)})") for k in range(shards)]
    sizes = [0] * shards
    for rank in range(20_000):
        owners = [k for k, p in enumerate(patterns) if p.fullmatch(str(rank))]
        assert owners == [rank % 100 % shards], rank
        sizes[owners[0]] += 1
    assert max(sizes) - min(sizes) <= 20_000 // 100, sizes  # balanced within one residue class


def test_only_per_rank_selectors_are_restricted() -> None:
    expr = ('rate(robust_step_compute_seconds_sum[1m]) / on (run) group_left () '
            'run:robust_step_compute_seconds:median1m * on (node, gpu) group_left () '
            'max by (node, gpu) (robust_gpu_peak_flops) and robust_phase{phase="train",} '
            'unless run_rank:robust_rank_info:last{node="a"}')
    out = rule_shards.shard_expr(expr, "R")
    assert out == ('rate(robust_step_compute_seconds_sum{rank=~"R"}[1m]) / on (run) group_left () '
                   'run:robust_step_compute_seconds:median1m * on (node, gpu) group_left () '
                   'max by (node, gpu) (robust_gpu_peak_flops) and '
                   'robust_phase{phase="train", rank=~"R"} '
                   'unless run_rank:robust_rank_info:last{node="a", rank=~"R"}')


def test_sharded_groups_hold_the_per_rank_rules_and_the_rest_stays() -> None:
    groups = rules.load_groups()
    sharded = rule_shards.shard_by_rank(groups, 4)
    names = [g["name"] for g in sharded]
    assert names.index("robust-topology-ranks-3") < names.index("robust-topology")
    per_rank = [r for g in groups for r in g["rules"]
                if (r.get("record") or r.get("alert")) in rule_shards.PER_RANK_RULES]
    assert {r.get("record") or r.get("alert") for r in per_rank} == rule_shards.PER_RANK_RULES
    assert sum(len(g["rules"]) for g in sharded) == (
        sum(len(g["rules"]) for g in groups) + 3 * len(per_rank))
    assert rule_shards.shard_by_rank(groups, 1) == groups


def test_sharded_rule_file_loads_in_promtool(tmp_path: Path) -> None:
    """Prometheus loads it; promtool's duplicate lint must be off (the same record name is
    defined once per shard, for disjoint ranks)."""
    promtool = require_binary("promtool")
    out = tmp_path / "rules.yml"
    cli = rules_cli("--rank-shards", "8", "--out", str(out))
    assert cli.returncode == 0, cli.stderr
    assert out.read_text().startswith("# Generated by `robust-metrics rules --rank-shards 8`")
    check = subprocess.run([promtool, "check", "rules", "--lint=none", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("value", ["0", "101", "x", "2.5"])
def test_bad_shard_counts_are_refused_with_a_message(value: str) -> None:
    cli = rules_cli("--rank-shards", value)
    assert cli.returncode == 2
    assert "--rank-shards" in cli.stderr and "Traceback" not in cli.stderr
