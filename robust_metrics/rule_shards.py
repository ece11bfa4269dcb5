"""Rule evaluation sharded by rank: the per-rank rules split over N groups of rank subsets.

Prometheus and vmalert evaluate the rules of one group one after the other, on one core, and
the groups in parallel. At 16,384 ranks a group that computes a rate per rank for every rank
takes seconds; split over N groups, each computing it for a disjoint 1/N of the ranks, the same
work runs on N cores and each group takes about 1/N of the time. Run-level rules (a median, a
minimum over ranks) stay in their group and read what the shards recorded.

Only rules listed in `PER_RANK_RULES` are sharded: their output has one series per rank and
nothing in them compares a rank with another. In a shard, every selector of a per-rank series
(a schema metric with a `rank` label, or a `run_rank`/`run_rank_group` record) gets a matcher
keeping that shard's ranks; run- and node-level selectors are left whole, so joins against a
run's median or a node's GPU peaks still find them.

A shard is chosen by the rank's last two decimal digits (rank mod 100), so shards stay balanced
for any run of more than a few hundred ranks and a rank's shard never changes. The price: a
run-level rule reads the shards' records from their last evaluation, up to one evaluation
interval old, so alerts that chain through a shard fire up to one interval later.
"""

from __future__ import annotations

import re
from typing import Any

from robust_metrics import schema

__all__ = ["MAX_SHARDS", "PER_RANK_RULES", "rank_regex", "shard_by_rank", "shard_expr"]

PER_RANK_RULES = frozenset({
    "run_rank:robust_rank_info:last",
    "NonFiniteLoss",
})
"""Rules computed rank by rank, with no comparison between ranks inside the expression, and
reading no record of their own group that is computed from every rank. (SlowRank is not one:
it counts the ranks that were its candidates in the run; it reads only sparse records and the
ranks' topology. The collectives-entered
record of a hang is per rank but reads whether the whole run hangs, which reads the step age of
every rank: sharded, it would lag the hang by an evaluation; it is recorded only while a run
hangs anyway.)"""

MAX_SHARDS = 100

_RANK_SAMPLES = frozenset(n for n, spec in schema.sample_names().items() if "rank" in spec.labels)
_SELECTOR = re.compile(r"(?<![\w:\"'])((?:robust_|run_rank:|run_rank_group:)[\w:]*)(\{[^}]*\})?")


def rank_regex(shard: int, shards: int) -> str:
    """A fully anchored regex of the decimal ranks r with r mod 100 mod `shards` == `shard`."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"rank shards must be between 1 and {MAX_SHARDS}, got {shards}")
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not one of 0..{shards - 1}")
    tails = [d for d in range(100) if d % shards == shard]
    short = "|".join(str(d) for d in tails)  # ranks 0-99, written without a leading zero
    long = "|".join(f"{d:02d}" for d in tails)  # the last two digits of ranks from 100
    return f"(?:{short})|[0-9]+(?:{long})" if shards > 1 else ".*"


def shard_expr(expr: str, regex: str) -> str:
    """`expr` with every per-rank selector restricted to the ranks that `regex` matches."""
    def restrict(m: re.Match[str]) -> str:
        name, matchers = m.group(1), m.group(2)
        if not (name in _RANK_SAMPLES or name.startswith(("run_rank:", "run_rank_group:"))):
            return m.group(0)
        matcher = f'rank=~"{regex}"'
        if not matchers or not matchers[1:-1].strip():
            return f"{name}{{{matcher}}}"
        return f"{name}{{{matchers[1:-1].rstrip().rstrip(',')}, {matcher}}}"
    return _SELECTOR.sub(restrict, expr)


def _rule_name(rule: dict[str, Any]) -> str:
    return str(rule.get("record") or rule.get("alert"))


def shard_by_rank(groups: list[dict[str, Any]], shards: int) -> list[dict[str, Any]]:
    """`groups` with their per-rank rules moved into `shards` groups per source group.

    The shard groups `<group>-ranks-<k>` come right before their source group (promtool
    evaluates groups in file order, so its unit tests see what an unsharded file gives), keep
    its interval, and hold the per-rank rules in their original order.
    """
    rank_regex(0, shards)  # validates `shards`
    if shards == 1:
        return groups
    out: list[dict[str, Any]] = []
    for group in groups:
        per_rank = [r for r in group["rules"] if _rule_name(r) in PER_RANK_RULES]
        if not per_rank:
            out.append(group)
            continue
        settings = {k: v for k, v in group.items() if k not in ("name", "rules")}
        for shard in range(shards):
            regex = rank_regex(shard, shards)
            out.append({"name": f"{group['name']}-ranks-{shard}", **settings,
                        "rules": [{**r, "expr": shard_expr(str(r["expr"]), regex)}
                                  for r in per_rank]})
        rest = [r for r in group["rules"] if _rule_name(r) not in PER_RANK_RULES]
        if rest:
            out.append({**group, "rules": rest})
    return out
