"""The `checkpoint` action: through the node sidecars, or by a signal through a scheduler.

The sidecars write each rank's control file and acknowledge in their own `/metrics`; without
configured sidecars, or when the step names a `scheduler`, SIGUSR1 goes to the run through the
scheduler (Slurm: `scancel --signal=USR1`; Kubernetes: a pod annotation the hook reads from a
downward API file; webhook: the receiver's) and the acknowledgement is read through Prometheus
(`robust_checkpoint_request_id`). Once the request ids (or the time of the signal) are saved, a
resumed step waits for the acknowledgement again; a signal is never sent twice.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from robust_metrics.bridge.config import BridgeConfig
from robust_metrics.bridge.prometheus import ACK_METRIC as SIGNAL_ACK
from robust_metrics.bridge.prometheus import PrometheusClient, PrometheusError
from robust_metrics.bridge.sidecars import SidecarClient, SidecarError
from robust_metrics.bridge.steps import Interrupted, Outcome, SchedulerFor, StepContext
from robust_metrics.numbers import rank_order

__all__ = ["CHECKPOINT_SIGNAL", "CheckpointAction"]

CHECKPOINT_SIGNAL = signal.SIGUSR1  # the hook's default `checkpoint_signal`


class CheckpointAction:
    """Runs `checkpoint` steps; `scheduler_for` is the bridge's lookup of a step's scheduler."""

    def __init__(self, config: BridgeConfig, sidecars: SidecarClient,
                 prometheus: PrometheusClient | None, scheduler_for: SchedulerFor,
                 stop: threading.Event) -> None:
        self.config = config
        self.sidecars = sidecars
        self.prometheus = prometheus
        self._scheduler = scheduler_for
        self.stop = stop

    def run(self, ctx: StepContext) -> Outcome:
        return self._checkpoint(ctx)

    def _checkpoint_scheduler(self, ctx: StepContext) -> str | None:
        """The scheduler a checkpoint goes through, or None for the sidecars.

        A step's own `scheduler` wins; without configured sidecars, the checkpoint taken before
        a restart uses the restart's scheduler, any other the default scheduler.
        """
        if ctx.options.get("scheduler"):
            return str(ctx.options["scheduler"])
        if self.config.sidecars.configured:
            return None
        plan = ctx.incident.plan
        if ctx.options.get("before_restart") and ctx.idx + 1 < len(plan):
            after = plan[ctx.idx + 1].options.get("scheduler")
            if after:
                return str(after)
        return self.config.default_scheduler

    def _checkpoint(self, ctx: StepContext) -> Outcome:
        scheduler = self._checkpoint_scheduler(ctx)
        if scheduler is not None:
            return self._checkpoint_by_signal(ctx, scheduler)
        run = ctx.incident.run
        requests: dict[str, int] = dict(ctx.data.get("requests") or {})
        data: dict[str, Any] = dict(ctx.data)
        if not requests:
            nodes = self.sidecars.nodes(run, ctx.incident.labels)
            if ctx.dry_run:
                return Outcome("dry_run", f"would ask the sidecars of {', '.join(nodes)} for a "
                               f"checkpoint of run {run}", {"nodes": nodes})
            errors: dict[str, str] = {}
            for node in nodes:
                try:
                    requests[node] = self.sidecars.request_checkpoint(
                        node, ctx.options.get("at_step"))
                except SidecarError as exc:
                    errors[node] = str(exc)
            data = {"nodes": nodes, "requests": requests, "errors": errors,
                    "deadline": time.time() + float(ctx.options.get("timeout_s", 120.0))}
            ctx.save(data)  # from here on a crash resumes the wait instead of asking again
            if not requests:
                return Outcome("failed", "no sidecar took the checkpoint request: "
                               + "; ".join(errors.values()), data)
        deadline = float(data.get("deadline", time.time()))
        pending = dict(requests)
        last: dict[str, str] = {}
        while True:
            for node, request_id in list(pending.items()):
                try:
                    ok, why = self.sidecars.acknowledged(run, node, request_id)
                except SidecarError as exc:
                    ok, why = False, str(exc)
                last[node] = why
                if ok:
                    del pending[node]
            if not pending or time.time() >= deadline:
                break
            if self.stop.wait(self.config.sidecars.ack_poll_s):
                raise Interrupted()
        data["acknowledged"] = sorted(set(requests) - set(pending))
        errors = dict(data.get("errors") or {})
        if pending:
            return Outcome("failed", "checkpoint not acknowledged before the timeout: "
                           + "; ".join(last[n] for n in sorted(pending)), data)
        if errors:
            return Outcome("failed", "checkpoint acknowledged on "
                           f"{', '.join(data['acknowledged'])} but not requested on: "
                           + "; ".join(errors.values()), data)
        return Outcome("success", f"checkpoint of run {run} acknowledged by all ranks on "
                       f"{', '.join(data['acknowledged'])}", data)

    def _checkpoint_by_signal(self, ctx: StepContext, name: str) -> Outcome:
        """SIGUSR1 to the run through the scheduler, then (with Prometheus) wait until every rank
        shows a newer `robust_checkpoint_request_id` than before the signal."""
        name, scheduler = self._scheduler(ctx, name)
        run = ctx.incident.run
        data: dict[str, Any] = dict(ctx.data)
        if "signal_ms" not in data:
            if ctx.dry_run:
                return Outcome("dry_run", f"would send {CHECKPOINT_SIGNAL.name} to run {run} "
                               f"through scheduler {name} for a checkpoint", {"scheduler": name})
            before = self._checkpoint_ids(run)
            data = {"scheduler": name, "signal": CHECKPOINT_SIGNAL.name, "before": before,
                    "signal_ms": time.time_ns() // 1_000_000,
                    "deadline": time.time() + float(ctx.options.get("timeout_s", 120.0))}
            ctx.save(data)  # from here on a crash waits for the acknowledgement, never re-signals
            result = scheduler.signal(run, CHECKPOINT_SIGNAL, key=ctx.key)
            data.update(result.data, delivered=result.ok)
            ctx.save(data)
            if not result.ok:
                return Outcome("failed", result.detail, data)
            data["detail"] = result.detail
        sent = str(data.get("detail") or f"{data['signal']} sent to run {run} through {name}")
        if self.prometheus is None:
            if not data.get("delivered"):
                return Outcome("failed", f"the bridge stopped while sending {data['signal']} to "
                               f"run {run}; whether it arrived is unknown (no prometheus.url to "
                               "read the acknowledgement from)", data)
            return Outcome("success", f"{sent}; acknowledgement not checked: prometheus.url is "
                           "not set", data)
        return self._await_checkpoint_ids(ctx, data, sent)

    def _checkpoint_ids(self, run: str) -> dict[str, float]:
        """rank -> newest checkpoint request id each rank of the run acknowledged (0: none)."""
        if self.prometheus is None:
            return {}
        return self.prometheus.checkpoint_ids(run)

    def _await_checkpoint_ids(self, ctx: StepContext, data: dict[str, Any],
                              sent: str) -> Outcome:
        run = ctx.incident.run
        before: dict[str, float] = dict(data.get("before") or {})
        deadline = float(data.get("deadline", time.time()))
        assert self.prometheus is not None  # the caller returned without one
        while True:
            try:
                now = self.prometheus.checkpoint_ids(run)
            except PrometheusError as exc:
                now, why = {}, str(exc)
            else:
                why = f"Prometheus shows no {SIGNAL_ACK} of run {run}"
            waiting = sorted((r for r in now if now[r] <= before.get(r, 0.0)), key=rank_order)
            if now and not waiting:
                data["acknowledged"] = sorted(now, key=rank_order)
                return Outcome("success", f"{sent}; checkpoint acknowledged by ranks "
                               f"{', '.join(data['acknowledged'])}", data)
            if waiting:
                why = f"ranks {', '.join(waiting)} have not acknowledged a new checkpoint request"
            if time.time() >= deadline:
                return Outcome("failed", f"{sent}; checkpoint not acknowledged before the "
                               f"timeout: {why}", data)
            if self.stop.wait(self.config.sidecars.ack_poll_s):
                raise Interrupted()
