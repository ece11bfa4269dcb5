"""What each action does: checkpoint, dump_stacks, selftest, restart, drain_node, notify.

Plain code that knows neither HTTP routes nor SQL: it gets a `StepContext` (the incident, the
step's options, a way to save progress durably) and returns an `Outcome`. The engine records
the step as running before calling in and the outcome after, and asks `resumable()` after a crash.

The `checkpoint` action (checkpoint_action.py) asks the node sidecars, or signals the run through
a scheduler; the `selftest` action (selftest_action.py) runs the nodes' self-tests and drains the
nodes that fail. The step's context and outcome are steps.py's.

Crash behaviour per action (a step found `running` at start):
- checkpoint: once the request ids (or the time of the signal) are saved, waiting for the
  acknowledgement resumes; a signal is never sent twice;
- dump_stacks: reads only, so it runs again;
- selftest: each node's verdict and each drain are saved as they come, so a resumed step asks
  only the nodes without a verdict and drains only the nodes not yet drained (each drain has
  its own key, `<step key>:<node>`);
- restart: publishes `robust_bridge_run_stop_timestamp_seconds` of the run and waits until
  Prometheus holds it (`notice_timeout_s`) before asking the scheduler, and publishes
  `robust_bridge_run_stop_end_timestamp_seconds` when the scheduler returns, so that RankExited
  reads the exits in between as requested and later ones as the new processes' own. When
  Prometheus scrapes no target that exposes the notice (the bridge is not in its scrape config),
  the wait lasts the whole timeout: the bridge says so once, as a warning that names the fix;
- restart / drain_node: resumed when the scheduler can tell whether the operation completed
  (`local` records the step key with the new pid), otherwise failed, never repeated;
- notify: failed, never repeated (a second page is worse than a logged gap).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from robust_metrics import schema
from robust_metrics.bridge.checkpoint_action import CheckpointAction
from robust_metrics.bridge.config import BridgeConfig, NotifyConfig
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.policy import eviction_nodes
from robust_metrics.bridge.prometheus import PrometheusClient, PrometheusError, promql_string
from robust_metrics.bridge.schedulers.base import ActionResult, Scheduler, SchedulerError
from robust_metrics.bridge.selftest_action import SelftestAction
from robust_metrics.bridge.sidecars import SidecarClient, SidecarError
from robust_metrics.bridge.signing import signed_request
from robust_metrics.bridge.steps import Interrupted, Outcome, StepContext
from robust_metrics.bridge.store import Incident, Step
from robust_metrics.rankfolder.identity import rank_info as identity_rank_info

__all__ = ["HANDLERS", "Actions", "Interrupted", "Notifier", "Outcome", "StepContext"]

log = logging.getLogger(__name__)
RUN_STOP = schema.RUN_STOP_TIMESTAMP.name


class Notifier:
    """POSTs a signed JSON message to `notify.url` (a chat relay, PagerDuty bridge, ...)."""

    def __init__(self, config: NotifyConfig) -> None:
        self.config = config
        self._http = httpx.Client(timeout=config.timeout_s)  # reused: no TLS set-up per message

    def send(self, payload: Mapping[str, Any], key: str) -> ActionResult:
        body, headers = signed_request(payload, self.config.secret, key)
        try:
            response = self._http.post(self.config.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return ActionResult(False, f"notify {self.config.url} unreachable: {exc!r}")
        if response.is_success:
            return ActionResult(True, f"notified {self.config.url} (HTTP {response.status_code})")
        return ActionResult(False, f"notify {self.config.url} answered HTTP "
                            f"{response.status_code}: {response.text[:300]}")

    def close(self) -> None:
        self._http.close()


def _analyse(dumps: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """Aggregate with `analysis.stacks.analyse` when it is installed."""
    try:
        from robust_metrics.analysis.stacks import analyse  # type: ignore[import-not-found]
    except ImportError:
        return None, "stack aggregation not installed; raw dumps stored"
    rank_info = identity_rank_info({**r, "node": r.get("node") or d.get("node")}
                                   for d in dumps for r in d.get("ranks", [])
                                   if isinstance(r, Mapping))
    try:
        result = analyse(dumps, rank_info)
    except Exception as exc:  # a bug in analysis must not lose the dumps
        log.exception("stack analysis failed")
        return None, f"stack analysis failed ({exc!r}); raw dumps stored"
    return (dict(result) if isinstance(result, Mapping) else {"result": result}), "analysed"


class Actions:
    """Runs steps against sidecars, schedulers and the notify webhook."""

    def __init__(self, config: BridgeConfig, sidecars: SidecarClient,
                 schedulers: Mapping[str, Scheduler], metrics: BridgeMetrics,
                 stop: threading.Event | None = None,
                 prometheus: PrometheusClient | None = None) -> None:
        self.config = config
        self.sidecars = sidecars
        self.prometheus = prometheus  # None: prometheus.url is not set
        self.schedulers = schedulers
        self.metrics = metrics
        self.notifier = Notifier(config.notify) if config.notify else None
        self.stop = stop or threading.Event()
        self._suspects: dict[str, set[tuple[str, str]]] = {}  # run -> (rank, node) now at 1
        self._unscraped_warned = threading.Event()  # the stop notice's warning, given once
        self.checkpoints = CheckpointAction(config, sidecars, prometheus, self._scheduler,
                                            self.stop)
        self.selftests = SelftestAction(sidecars, self._scheduler, self._reason, self.stop)

    # ------------------------------------------------------------------ dispatch
    def run(self, ctx: StepContext) -> Outcome:
        kind = ctx.spec.kind
        if kind in ("checkpoint", "dump_stacks", "restart") and not ctx.incident.run:
            return Outcome("failed", f"{kind} needs the alert's `{self.config.run_label}` label "
                           "(the training job); this alert has none")
        handler = HANDLERS.get(kind)
        if handler is None:  # a plan stored by a bridge that knows more actions
            return Outcome("failed", f"unknown action {kind!r} (this bridge runs "
                           f"{', '.join(HANDLERS)})")
        try:
            return handler(self, ctx)
        except Interrupted:
            raise
        except (SchedulerError, SidecarError, PrometheusError) as exc:
            return Outcome("failed", str(exc), ctx.data)
        except Exception as exc:  # an action bug fails the step, not the bridge
            log.exception("action %s of incident %s failed", kind, ctx.incident.key)
            return Outcome("failed", f"internal error: {exc!r}", ctx.data)

    def resumable(self, step: Step, incident: Incident | None) -> bool:
        if incident is None:
            return False
        if step.action == "checkpoint":
            return bool(step.data.get("requests") or step.data.get("signal_ms"))
        if step.action in ("dump_stacks", "selftest"):
            return True
        if step.action in ("restart", "drain_node"):
            options = incident.plan[step.idx].options if step.idx < len(incident.plan) else {}
            scheduler = self.schedulers.get(options.get("scheduler") or "")
            if scheduler is None or step.action == "drain_node":
                return False
            return scheduler.completed(incident.run, f"{incident.key}#{step.idx}") is not None
        return False

    def _scheduler(self, ctx: StepContext, name: str | None = None) -> tuple[str, Scheduler]:
        name = name or ctx.options.get("scheduler") or self.config.default_scheduler
        if not name or name not in self.schedulers:
            raise SchedulerError(f"no scheduler {name!r} configured for {ctx.spec.kind}")
        return name, self.schedulers[name]

    def _reason(self, ctx: StepContext) -> str:
        i = ctx.incident
        summary = i.annotations.get("summary", "")
        return f"robust-metrics bridge: {i.alertname} on run {i.run}" + (
            f": {summary}" if summary else "") + f" [{ctx.key}]"

    # ------------------------------------------------------------------ actions
    def _checkpoint(self, ctx: StepContext) -> Outcome:
        return self.checkpoints.run(ctx)

    def _dump_stacks(self, ctx: StepContext) -> Outcome:
        run = ctx.incident.run
        nodes = self.sidecars.nodes(run, ctx.incident.labels)
        if ctx.dry_run:
            return Outcome("dry_run", f"would collect stacks of run {run} from "
                           f"{', '.join(nodes)}", {"nodes": nodes})
        dumps: list[dict[str, Any]] = []
        errors: dict[str, str] = {}
        for node in nodes:
            try:
                dump = self.sidecars.stacks(node)
            except SidecarError as exc:
                errors[node] = str(exc)
                continue
            dump["ranks"] = [r for r in dump["ranks"]
                             if not isinstance(r, Mapping) or r.get("run") in (None, run)]
            dumps.append(dump)
        if not dumps:
            return Outcome("failed", "no sidecar returned stacks: " + "; ".join(errors.values()),
                           {"nodes": nodes, "errors": errors})
        analysis, how = _analyse(dumps)
        data: dict[str, Any] = {"nodes": nodes, "errors": errors, "analysis": analysis}
        if analysis is None:
            data["dumps"] = dumps
        if analysis is not None:
            self._publish_suspects(run, analysis.get("suspects") or [])
        ranks = sum(len(d["ranks"]) for d in dumps)
        status = "success" if not errors else "failed"
        missing = f"; no answer from {', '.join(sorted(errors))}" if errors else ""
        return Outcome(status, f"stacks of {ranks} ranks from {len(dumps)} node(s), {how}"
                       + missing, data)

    def _publish_suspects(self, run: str, suspects: list[Any]) -> None:
        """`robust_hang_suspect` shows the latest analysis of the run: older suspects go."""
        now = {(str(s["rank"]), str(s.get("node") or "")) for s in suspects
               if isinstance(s, Mapping) and "rank" in s}
        for rank, node in self._suspects.get(run, set()) - now:
            with contextlib.suppress(KeyError):
                self.metrics.hang_suspect.remove(run, rank, node)
        for rank, node in now:
            self.metrics.hang_suspect.labels(run=run, rank=rank, node=node).set(1)
        self._suspects[run] = now

    def _selftest(self, ctx: StepContext) -> Outcome:
        return self.selftests.run(ctx)

    def _restart(self, ctx: StepContext) -> Outcome:
        name, scheduler = self._scheduler(ctx)
        run = ctx.incident.run
        if ctx.dry_run:
            return Outcome("dry_run", f"would restart run {run} through scheduler {name}")
        if ctx.resumed and scheduler.completed(run, ctx.key):
            return Outcome("success", f"restart of run {run} had completed before the bridge "
                           "restarted", {"scheduler": name})
        notice = self._announce_stop(run, float(ctx.options.get("notice_timeout_s", 60.0)))
        try:
            result = scheduler.restart(run, self._reason(ctx), key=ctx.key)
        finally:
            self.metrics.run_stop_end.labels(run=run).set(time.time())
        return Outcome("success" if result.ok else "failed", result.detail,
                       {"scheduler": name, **result.data, "stop_notice": notice,
                        "highest_step": ctx.spec.highest_step})

    def _announce_stop(self, run: str, timeout_s: float) -> str:
        """Publish that the bridge is about to stop `run`, and wait (at most `timeout_s`) until
        Prometheus holds it: the rules then read every exit that follows as requested, never as
        a crash, because the notice is stored before the first exit can be."""
        began = time.time()
        self.metrics.run_stop.labels(run=run).set(began)
        if self.prometheus is None:
            return "published; not awaited (prometheus.url is not set)"
        floor = f"{began - 0.001:.3f}"  # printed, never rounded above what was set
        promql = f"{RUN_STOP}{{run={promql_string(run)}}} >= {floor}"
        unscraped: str | None = None  # why no scrape will deliver it; asked after a first miss
        while True:
            try:
                if self.prometheus.query(promql):
                    return f"seen by Prometheus after {time.time() - began:.1f} s"
            except PrometheusError as exc:
                log.warning("stop notice of run %s: %s", run, exc)
            if unscraped is None:
                unscraped = self._notice_unscraped(run, timeout_s)
            if time.time() - began >= timeout_s:
                return (f"not seen by Prometheus within {timeout_s:g} s; stopped anyway"
                        + (f" ({unscraped})" if unscraped else ""))
            if self.stop.wait(0.25):
                raise Interrupted()

    def _notice_unscraped(self, run: str, timeout_s: float) -> str:
        """Why no scrape will deliver the stop notice ('' when one may, or when Prometheus
        cannot say); the first time, a warning that says why the restart waits and the fix."""
        assert self.prometheus is not None
        try:
            if self.prometheus.scraped(RUN_STOP):
                return ""
        except PrometheusError as exc:  # e.g. a backend without the metadata API: no verdict
            log.debug("stop notice of run %s: cannot tell whether the bridge is scraped: %s",
                      run, exc)
            return ""
        why = f"no target of Prometheus exposes {RUN_STOP}: the bridge is not scraped"
        if not self._unscraped_warned.is_set():
            self._unscraped_warned.set()
            log.warning(
                "restart of run %s waits %g s (notice_timeout_s) for Prometheus to store the "
                "bridge's stop notice (%s), which tells the rules that the exits that follow "
                "were asked for, not crashes; but Prometheus at %s scrapes no target that "
                "exposes it, so every restart waits the whole timeout and RankExited may fire "
                "for its exits. Fix: add the bridge's /metrics (http://%s:%d/metrics, with its "
                "credentials if auth.protect_metrics is set) to Prometheus's scrape_configs; "
                "see 'The stop notice' in docs/bridge.md. Said once.", run, timeout_s, RUN_STOP,
                self.prometheus.url, self.config.host, self.config.port)
        return why

    def _drain_node(self, ctx: StepContext) -> Outcome:
        if ctx.spec.over_evict:
            return self._over_evict(ctx)
        name, scheduler = self._scheduler(ctx)
        node = ctx.incident.labels.get("node")
        if not node:
            return Outcome("failed", "drain_node needs a `node` label on the alert")
        if ctx.dry_run:
            return Outcome("dry_run", f"would drain node {node} through scheduler {name}")
        result = scheduler.drain_node(node, self._reason(ctx), key=ctx.key)
        return Outcome("success" if result.ok else "failed", result.detail,
                       {"scheduler": name, "node": node, **result.data})

    def _over_evict(self, ctx: StepContext) -> Outcome:
        """Drain every node that holds a suspect of the latest stack analysis of the incident;
        `evicted_nodes` in the step's data is how many nodes that took."""
        name, scheduler = self._scheduler(ctx)
        analyses = [s.data.get("analysis") for s in ctx.earlier
                    if s.action == "dump_stacks" and s.data.get("analysis")]
        suspects = [s for s in ((analyses[-1] or {}).get("suspects") or []) if
                    isinstance(s, Mapping) and "rank" in s] if analyses else []
        if not suspects:
            return Outcome("failed", "over-eviction: the stack analysis named no suspect rank; "
                           "nothing drained")
        nodes, unplaced = eviction_nodes(suspects)
        data: dict[str, Any] = {"scheduler": name, "nodes": nodes, "suspects": len(suspects),
                                "evicted_nodes": len(nodes), "unplaced": unplaced}
        if not nodes:
            return Outcome("failed", "over-eviction: no node known for suspect ranks "
                           f"{', '.join(unplaced)}; nothing drained", data)
        what = (f"{len(nodes)} node(s) ({', '.join(nodes)}) for {len(suspects)} suspect "
                f"rank(s)")
        if ctx.dry_run:
            return Outcome("dry_run", f"would drain {what} through scheduler {name}", data)
        failed = {}
        for node in nodes:
            result = scheduler.drain_node(node, self._reason(ctx), key=f"{ctx.key}:{node}")
            if not result.ok:
                failed[node] = result.detail
        data["errors"] = failed
        missing = f"; no node for ranks {', '.join(unplaced)}" if unplaced else ""
        if failed:
            return Outcome("failed", f"over-eviction of {what}: drain failed on "
                           f"{', '.join(sorted(failed))}{missing}", data)
        return Outcome("success", f"over-eviction: drained {what}{missing}", data)

    def _notify(self, ctx: StepContext) -> Outcome:
        i = ctx.incident
        message = ctx.options.get("message") or i.annotations.get("summary") or (
            f"{i.alertname} on run {i.run}")
        if ctx.dry_run:
            return Outcome("dry_run", f"would notify: {message}")
        if self.notifier is None:
            return Outcome("failed", f"cannot notify ({message}): notify.url is not set")
        payload = {"kind": "robust-metrics-bridge", "message": message, "run": i.run,
                   "alertname": i.alertname, "incident": i.key, "step": ctx.key,
                   "labels": i.labels, "annotations": i.annotations,
                   "escalated_from": ctx.spec.escalated_from}
        result = self.notifier.send(payload, ctx.key)
        return Outcome("success" if result.ok else "failed", result.detail)


# What runs each action: the one place an action name meets its code (config.ACTIONS declares
# the same names and their options). A stored plan naming another fails its step, never the bridge.
HANDLERS: dict[str, Callable[[Actions, StepContext], Outcome]] = {
    "checkpoint": Actions._checkpoint,
    "dump_stacks": Actions._dump_stacks,
    "selftest": Actions._selftest,
    "restart": Actions._restart,
    "drain_node": Actions._drain_node,
    "notify": Actions._notify,
}
