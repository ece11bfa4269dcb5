"""The `selftest` action: each node of the run runs its self-test, the nodes are held against
each other, and the nodes that fail are drained, so that the restart after it lands elsewhere.

Each node's verdict and each drain are saved as they come: a resumed step asks only the nodes
without a verdict and drains only the nodes not yet drained (each drain has its own key,
`<step key>:<node>`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from robust_metrics.bridge.demarcation import node_verdict, peer_outliers
from robust_metrics.bridge.sidecars import SidecarClient, SidecarError
from robust_metrics.bridge.steps import Interrupted, Outcome, SchedulerFor, StepContext

__all__ = ["SelftestAction"]


class SelftestAction:
    """Runs `selftest` steps; `scheduler_for` finds the step's scheduler (for the drains) and
    `reason` the text a drain is recorded with."""

    def __init__(self, sidecars: SidecarClient, scheduler_for: SchedulerFor,
                 reason: Callable[[StepContext], str], stop: threading.Event) -> None:
        self.sidecars = sidecars
        self._scheduler = scheduler_for
        self._reason = reason
        self.stop = stop

    def run(self, ctx: StepContext) -> Outcome:
        return self._selftest(ctx)

    def _selftest(self, ctx: StepContext) -> Outcome:
        """Ask each node of the run for its self-test, hold the nodes against each other, and
        drain the nodes that fail; the restart after this step then lands on the others."""
        data: dict[str, Any] = dict(ctx.data)
        nodes = list(data.get("nodes") or self.sidecars.nodes(ctx.incident.run,
                                                               ctx.incident.labels))
        if ctx.dry_run:
            return Outcome("dry_run", f"would run the self-test on {', '.join(nodes)} and drain "
                           "the nodes that fail", {"nodes": nodes})
        data["nodes"] = nodes
        verdicts = self._selftest_verdicts(ctx, data)
        outliers = peer_outliers(verdicts, float(ctx.options.get("min_fraction", 0.5)))
        for node, why in outliers.items():
            own = verdicts[node].get("detail")
            verdicts[node] = {**verdicts[node], "verdict": "fail",
                              "detail": f"{own}; {why}" if own else why,
                              "failed": sorted({*verdicts[node].get("failed", []), "compute"})}
        data["failed"] = sorted(n for n, v in verdicts.items() if v["verdict"] == "fail")
        unreachable = sorted(n for n, v in verdicts.items() if v["verdict"] == "error")
        data.update(verdicts=verdicts, unreachable=unreachable)
        ctx.save(data)
        if data["failed"] and ctx.options.get("drain", True):
            self._drain_failed(ctx, data)
        return self._selftest_outcome(data)

    def _selftest_verdicts(self, ctx: StepContext, data: dict[str, Any]) -> dict[str, Any]:
        """node -> verdict, asking only the nodes without one (a resumed step keeps the rest)."""
        verdicts: dict[str, Any] = dict(data.get("verdicts") or {})
        body: dict[str, Any] = {"quick": bool(ctx.options.get("quick", True))}
        if ctx.options.get("checks"):
            body["checks"] = [c.strip() for c in str(ctx.options["checks"]).split(",")]
        for node in data["nodes"]:
            if node in verdicts:
                continue
            if self.stop.is_set():
                raise Interrupted()
            try:
                verdicts[node] = node_verdict(self.sidecars.selftest(
                    node, body, float(ctx.options.get("timeout_s", 330.0))))
            except SidecarError as exc:
                verdicts[node] = {"verdict": "error", "failed": [], "detail": str(exc)}
            ctx.save({**data, "verdicts": verdicts})
        return verdicts

    def _drain_failed(self, ctx: StepContext, data: dict[str, Any]) -> None:
        name, scheduler = self._scheduler(ctx, None)
        drained: dict[str, Any] = dict(data.get("drained") or {})
        for node in data["failed"]:
            if (drained.get(node) or {}).get("ok"):
                continue
            why = data["verdicts"][node].get("detail") or "self-test failed"
            result = scheduler.drain_node(node, f"{self._reason(ctx)}: self-test failed: {why}",
                                          key=f"{ctx.key}:{node}")
            drained[node] = {"ok": result.ok, "detail": result.detail}
            data.update(drained=drained, scheduler=name)
            ctx.save(data)

    @staticmethod
    def _selftest_outcome(data: dict[str, Any]) -> Outcome:
        verdicts, failed = data["verdicts"], data["failed"]
        drained = data.get("drained") or {}
        summary = ", ".join(f"{n} {v['verdict']}" for n, v in sorted(verdicts.items()))
        bad_drains = sorted(n for n, d in drained.items() if not d.get("ok"))
        if len(data["unreachable"]) == len(verdicts):
            return Outcome("failed", f"no sidecar ran the self-test: {summary}", data)
        if bad_drains:
            return Outcome("failed", f"self-test: {summary}; drain failed on "
                           f"{', '.join(bad_drains)}: "
                           + "; ".join(drained[n]["detail"] for n in bad_drains), data)
        done = f"; drained {', '.join(failed)}" if drained else ""
        return Outcome("success", f"self-test: {summary}{done}", data)
