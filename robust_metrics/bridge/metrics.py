"""The bridge's own metrics, built from the specs in `robust_metrics.schema` (bridge section).

One registry per bridge instance (not the global default), so tests can run several bridges in one
process and `/metrics` shows only what this bridge did.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from robust_metrics import schema

__all__ = ["BridgeMetrics"]


class BridgeMetrics:
    """Webhook requests by status, actions by run/action/result, action duration, hang suspects,
    and when the bridge began and ended stopping each run."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        w, a, d, h = (schema.BRIDGE_WEBHOOKS, schema.BRIDGE_ACTIONS,
                      schema.BRIDGE_ACTION_DURATION, schema.HANG_SUSPECT)
        self.webhooks = Counter(w.base_name, w.help, w.labels, registry=self.registry)
        self.actions = Counter(a.base_name, a.help, a.labels, registry=self.registry)
        self.duration = Histogram(d.base_name, d.help, d.labels, buckets=d.buckets,
                                  registry=self.registry)
        self.hang_suspect = Gauge(h.base_name, h.help, h.labels, registry=self.registry)
        stop, end = schema.RUN_STOP_TIMESTAMP, schema.RUN_STOP_END_TIMESTAMP
        self.run_stop = Gauge(stop.base_name, stop.help, stop.labels, registry=self.registry)
        self.run_stop_end = Gauge(end.base_name, end.help, end.labels, registry=self.registry)

    def action(self, run: str, action: str, result: str, seconds: float | None) -> None:
        self.actions.labels(run=run, action=action, result=result).inc()
        if seconds is not None:
            self.duration.labels(action=action).observe(seconds)
