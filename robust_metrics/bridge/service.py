"""The bridge as one object: store, engine, schedulers and the accept logic, without HTTP.

`Bridge.handle()` turns a validated Alertmanager notification into incidents: firing alerts are
matched to a rule and recorded once (fingerprint + startsAt), resolved ones cancel what has not
acted yet. The HTTP layer (`app.py`) only authenticates, limits and validates.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from robust_metrics.bridge import policy
from robust_metrics.bridge.actions import Actions
from robust_metrics.bridge.config import BridgeConfig
from robust_metrics.bridge.demarcation import node_verdict
from robust_metrics.bridge.engine import Engine
from robust_metrics.bridge.ledger import Entry, Ledger, persistent_finding
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.payload import Notification
from robust_metrics.bridge.prometheus import PrometheusClient
from robust_metrics.bridge.sidecars import SidecarClient, SidecarError
from robust_metrics.bridge.store import ActionStore, NewAlert

__all__ = ["Bridge"]

log = logging.getLogger(__name__)


class Bridge:
    """Everything a running bridge holds; `start()` recovers and starts the workers."""

    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        self.metrics = BridgeMetrics()
        self.schedulers = {name: s.create() for name, s in config.schedulers.items()}
        self.store = ActionStore(config.database)
        self.prometheus = (PrometheusClient(config.prometheus_url, config.sidecars.timeout_s)
                           if config.prometheus_url else None)
        self.sidecars = SidecarClient(config.sidecars, self.prometheus)
        self.actions = Actions(config, self.sidecars, self.schedulers, self.metrics,
                               prometheus=self.prometheus)
        self.engine = Engine(config, self.store, self.actions, self.metrics)
        self.ledger = Ledger(config, self.store, self.metrics,
                             self.prometheus.query if self.prometheus else None)
        self.ledger.on_nan_verdict = self._on_nan_verdict
        self.engine.nan_finding = self.ledger.persistent_nan
        self.engine.nan_pending = self.ledger.pending_nan
        self.recovery_notes: list[str] = []

    def _on_nan_verdict(self, entry: Entry) -> dict[str, Any]:
        """A persistent value: tell people (the restarts stop); a transient one: test the node
        of the rank that reported it first with the compute check."""
        finding = entry.numerics
        if finding.get("verdict") == "persistent":
            if self.actions.notifier is None:
                return {"notified": "not notified: notify.url is not set"}
            payload = {"kind": "robust-metrics-bridge", "run": entry.run,
                       "alertname": entry.alertname, "incident": entry.incident_id,
                       "message": f"run {entry.run}: {persistent_finding(finding)}; the bridge "
                                  "stops restarting it: the data or the model is at fault",
                       "step": finding.get("step"), "rank": finding.get("rank"),
                       "node": finding.get("node"), "batch": finding.get("batch"),
                       "verdict": "persistent"}
            result = self.actions.notifier.send(payload, f"nan-{entry.incident_id}")
            return {"notified": result.detail}
        node = finding.get("node")
        if finding.get("verdict") != "transient" or not node:
            return {}
        try:
            report = self.sidecars.selftest(node, {"quick": True, "checks": ["compute"]}, 330.0)
            verdict = node_verdict(report)
        except SidecarError as exc:
            verdict = {"verdict": "error", "failed": [], "detail": str(exc)}
        return {"selftest": {node: {**verdict, "drained": False}}}

    def start(self) -> None:
        self.recovery_notes = self.engine.recover()
        self.engine.start()
        self.ledger.start()

    def close(self) -> None:
        self.ledger.stop()
        self.engine.stop()
        self.sidecars.close()
        if self.prometheus is not None:
            self.prometheus.close()
        if self.actions.notifier is not None:
            self.actions.notifier.close()
        for scheduler in self.schedulers.values():
            scheduler.close()
        self.store.close()

    def handle(self, notification: Notification) -> dict[str, Any]:
        """Record a notification; returns counts for the webhook's answer."""
        new: list[NewAlert] = []
        resolved: list[tuple[str, str, str, str]] = []
        run_label = self.config.run_label
        for alert in notification.alerts:
            run = alert.labels.get(run_label, "")
            name = alert.labels["alertname"]
            if alert.status == "resolved":
                resolved.append((alert.fingerprint, alert.starts_at, run, name))
                continue
            # Recorded now: the rule, its plan and when it is due. History (cooldown, budget)
            # is read when a worker claims it, and the same function decides again then.
            decision = policy.decide(self.config, policy.AlertFacts(alert.labels,
                                                                    alert.starts_at),
                                     policy.History(), time.time())
            new.append(NewAlert(alert.fingerprint, alert.starts_at, run, name, alert.labels,
                                alert.annotations, decision.rule, decision.plan,
                                decision.not_before))
        fresh = self.store.accept(new) if new else []
        cancelled = self.store.resolve(resolved) if resolved else 0
        if any(fresh):
            self.engine.wake()
        matched = [a for a, f in zip(new, fresh, strict=True) if f and a.rule]
        return {"accepted": len(matched),
                "duplicates": sum(1 for f in fresh if not f),
                "unmatched": sum(1 for a, f in zip(new, fresh, strict=True) if f and not a.rule),
                "resolved": len(resolved), "cancelled": cancelled}
