"""Over-eviction: a hang that names several suspect ranks drains the smallest set of nodes that
holds all of them (`policy.eviction_nodes`, the plan from `policy.decide`, the drain in
`Actions`), and the ledger notes how many nodes that took. The scheduler is a recording fake at
the scheduler protocol's boundary."""

from __future__ import annotations

from typing import Any

from robust_metrics.bridge.actions import Actions, StepContext
from robust_metrics.bridge.config import BridgeConfig, parse
from robust_metrics.bridge.ledger import named, over_eviction_note
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.policy import AlertFacts, History, decide, eviction_nodes
from robust_metrics.bridge.schedulers.base import ActionResult
from robust_metrics.bridge.store import Incident, Step

T0 = 1767225600.0  # 2026-01-01T00:00:00Z
START = "2026-01-01T00:00:00Z"
SUSPECTS = [{"rank": 4, "node": "n2"}, {"rank": 5, "node": "n2"}, {"rank": 6, "node": "n3"},
            {"rank": 7, "node": "n3"}]


class Recorder:
    """A scheduler that records drains; `fail` names nodes whose drain fails."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.drained: list[tuple[str, str | None]] = []
        self.fail = fail

    def drain_node(self, node: str, reason: str, *, key: str | None = None) -> ActionResult:
        self.drained.append((node, key))
        return ActionResult(node not in self.fail, f"drain {node}")


def config(over_eviction: bool = True, dry_run: bool = False) -> BridgeConfig:
    return parse({
        "auth": {"bearer_token": "t"}, "dry_run": dry_run,
        "schedulers": {"ops": {"type": "webhook", "url": "http://127.0.0.1:1"}},
        "incidents": {"over_eviction": over_eviction},
        "rules": [{"name": "evict", "match": {"action": "drain_node"}, "scheduler": "ops",
                   "actions": ["drain_node"]}]})


def hang(**labels: str) -> AlertFacts:
    return AlertFacts({"alertname": "TrainingHang", "action": "drain_node", "run": "r1",
                       **labels}, START)


def test_the_smallest_cover_is_the_suspects_nodes() -> None:
    assert eviction_nodes(SUSPECTS) == (["n2", "n3"], [])
    assert eviction_nodes([{"rank": 1, "node": "n1"}, {"rank": 2}]) == (["n1"], ["2"])
    assert eviction_nodes([]) == ([], [])


def test_a_hang_without_a_node_drains_the_suspects_nodes_after_a_stack_dump() -> None:
    plan = decide(config(), hang(), History(), T0).plan
    assert [s["type"] for s in plan] == ["dump_stacks", "drain_node"]
    assert plan[1]["over_evict"] is True and plan[1]["options"]["scheduler"] == "ops"


def test_over_eviction_applies_only_when_enabled_to_hangs_without_a_node() -> None:
    for cfg, facts in ((config(over_eviction=False), hang()),
                       (config(), hang(node="n9")),
                       (config(), AlertFacts({"alertname": "GPUXidCritical", "run": "r1",
                                              "action": "drain_node"}, START))):
        plan = decide(cfg, facts, History(), T0).plan
        assert [s["type"] for s in plan] == ["drain_node"]
        assert "over_evict" not in plan[0]


def _incident(plan: list[dict[str, Any]]) -> Incident:
    return Incident(1, "fp@start", "fp", START, "r1", "TrainingHang", "evict",
                    {"alertname": "TrainingHang", "run": "r1"}, {}, plan, "running", "", T0,
                    T0, T0, T0, 1)


def _dump(suspects: list[dict[str, Any]]) -> Step:
    return Step(1, 0, "dump_stacks", "success", "", {"analysis": {"suspects": suspects}}, T0,
                T0 + 1)


def _drain(cfg: BridgeConfig, scheduler: Recorder, earlier: list[Step]) -> Any:
    plan = decide(cfg, hang(), History(), T0).plan
    actions = Actions(cfg, None, {"ops": scheduler}, BridgeMetrics())  # type: ignore[arg-type,dict-item]
    return actions.run(StepContext(_incident(plan), 1, plan[1], lambda _: None,
                                   earlier=earlier))


def test_the_drain_covers_every_suspect_with_two_nodes_for_four_ranks() -> None:
    ops = Recorder()
    out = _drain(config(), ops, [_dump(SUSPECTS)])
    assert out.status == "success", out.detail
    assert ops.drained == [("n2", "fp@start#1:n2"), ("n3", "fp@start#1:n3")]
    assert (out.data["nodes"], out.data["evicted_nodes"], out.data["suspects"]) == (
        ["n2", "n3"], 2, 4)
    step = Step(1, 1, "drain_node", out.status, out.detail, out.data, T0 + 1, T0 + 2)
    assert over_eviction_note([_dump(SUSPECTS), step]) == (
        "over-eviction: 2 node(s) for 4 suspect rank(s), success")
    _, nodes = named(_incident([]), [_dump(SUSPECTS), step])
    assert nodes == ["n2", "n3"]


def test_the_latest_analysis_counts_and_nothing_is_drained_without_suspects() -> None:
    ops = Recorder()
    out = _drain(config(), ops, [_dump(SUSPECTS), _dump([{"rank": 3, "node": "n1"}])])
    assert out.status == "success" and ops.drained == [("n1", "fp@start#1:n1")]
    ops = Recorder()
    out = _drain(config(), ops, [_dump([])])
    assert out.status == "failed" and "no suspect" in out.detail and ops.drained == []
    out = _drain(config(), ops, [_dump([{"rank": 3}])])
    assert out.status == "failed" and "no node known for suspect ranks 3" in out.detail
    assert ops.drained == []


def test_a_failed_drain_fails_the_step_and_dry_run_drains_nothing() -> None:
    ops = Recorder(fail=("n3",))
    out = _drain(config(), ops, [_dump(SUSPECTS)])
    assert out.status == "failed" and "drain failed on n3" in out.detail
    assert [n for n, _ in ops.drained] == ["n2", "n3"]
    ops = Recorder()
    out = _drain(config(dry_run=True), ops, [_dump(SUSPECTS)])
    assert out.status == "dry_run" and ops.drained == []
    assert "2 node(s) (n2, n3) for 4 suspect rank(s)" in out.detail
    assert over_eviction_note([]) == ""
