"""Talking to the node sidecars: where a run's ranks are, and what they said.

The sidecar offers `POST /control/checkpoint` (bearer token; body `{"at_step": n}`; answers
`{"request_id": n, ...}`), `GET /debug/stacks` (`{node, ranks: [{run, rank, pid, threads, error}]}`),
`POST /control/selftest` (bearer token; body `{"quick": true, "checks": [...]}`; answers the node's
self-test report `{node, verdict, failed, results: [...]}`) and `/metrics`, where each rank's
`robust_checkpoint_request_id` acknowledges the newest checkpoint
request it has handled. Nodes of a run come from the alert (`node`, or `nodes` comma-separated) or
from Prometheus (`robust_rank_info{run=...}`). Either way a job wrote the name: it is looked up in
the configured sidecar hosts (`SidecarEndpoints.url`) or, with `sidecars.discovery_job`, among
the targets Prometheus scrapes in that job (service discovery the operator configured); a name
that is neither is never contacted, so the bearer token cannot be sent where a label points.
What this client reads from Prometheus it reads through the bridge's `PrometheusClient`, and
reports a failure there as a `SidecarError` like any other (a step fails per node, not whole).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from robust_metrics.bridge.config import SidecarEndpoints
from robust_metrics.bridge.prometheus import (
    ACK_METRIC,
    INFO_METRIC,
    PrometheusClient,
    PrometheusError,
    promql_string,
)

__all__ = ["ACK_METRIC", "SidecarClient", "SidecarError", "nodes_from_labels", "promql_string"]
TARGETS_TTL_S = 30.0  # how long a read of Prometheus's targets is reused
TARGETS_MISS_TTL_S = 2.0  # re-read sooner for a node not found (a sidecar that just appeared)


class SidecarError(RuntimeError):
    """A sidecar or Prometheus could not be reached or gave an unusable answer."""


def nodes_from_labels(labels: Mapping[str, str]) -> list[str]:
    raw = labels.get("nodes") or labels.get("node") or ""
    return sorted({n.strip() for n in raw.split(",") if n.strip()})


class SidecarClient:
    """HTTP client for the sidecars (bearer token); Prometheus, when given, says where a run's
    ranks are, which sidecars it scrapes and, with `ack_source: prometheus`, what they
    acknowledged."""

    def __init__(self, config: SidecarEndpoints,
                 prometheus: PrometheusClient | None = None) -> None:
        self.config = config
        self.prometheus = prometheus
        headers = {"User-Agent": "robust-metrics-bridge"}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        # Redirects are not followed: a sidecar cannot forward the token elsewhere either.
        self._http = httpx.Client(timeout=config.timeout_s, headers=headers,
                                  follow_redirects=False)
        self._targets_lock = threading.Lock()
        self._targets: tuple[float, list[tuple[Mapping[str, str], str]]] = (float("-inf"), [])

    def close(self) -> None:
        self._http.close()

    def _query(self, promql: str) -> list[dict[str, Any]]:
        if self.prometheus is None:
            raise SidecarError("prometheus.url is not configured")
        try:
            return self.prometheus.query(promql)
        except PrometheusError as exc:
            raise SidecarError(str(exc)) from exc

    def nodes(self, run: str, labels: Mapping[str, str]) -> list[str]:
        """The run's nodes: from the alert labels, else from robust_rank_info in Prometheus."""
        nodes = nodes_from_labels(labels)
        if nodes:
            return nodes
        if self.prometheus is None:
            raise SidecarError(f"no node for run {run!r}: the alert has no `node` label and "
                               "prometheus.url is not configured")
        result = self._query(f"group by (node) ({INFO_METRIC}{{run={promql_string(run)}}})")
        nodes = sorted({r["metric"].get("node", "") for r in result} - {""})
        if not nodes:
            raise SidecarError(f"Prometheus knows no ranks of run {run!r} ({INFO_METRIC})")
        return nodes

    def _scrape_targets(self, max_age_s: float) -> list[tuple[Mapping[str, str], str]]:
        """(labels, base URL) of the active targets of `sidecars.discovery_job`, kept a while."""
        with self._targets_lock:
            read_at, targets = self._targets
            if time.monotonic() - read_at < max_age_s:
                return targets
            if self.prometheus is None:
                raise SidecarError("prometheus.url is not configured")
            try:
                active = self.prometheus.active_targets()
            except PrometheusError as exc:
                raise SidecarError(str(exc)) from exc
            targets = []
            for t in active:
                labels, scrape = t.get("labels") or {}, urlsplit(str(t.get("scrapeUrl", "")))
                if labels.get("job") == self.config.discovery_job and scrape.scheme in (
                        "http", "https") and scrape.hostname:
                    targets.append((labels, f"{scrape.scheme}://{scrape.netloc}"))
            self._targets = (time.monotonic(), targets)
            return targets

    def _discovered(self, node: str) -> str | None:
        """The one sidecar target whose `node` (or `instance`) target label is `node`."""
        for max_age_s in (TARGETS_TTL_S, TARGETS_MISS_TTL_S):
            bases = {base for labels, base in self._scrape_targets(max_age_s)
                     if node in (labels.get("node"), labels.get("instance"))}
            if bases:
                break
        return bases.pop() if len(bases) == 1 else None

    # ------------------------------------------------------------------ sidecar
    def _call(self, method: str, node: str, path: str, **kwargs: Any) -> httpx.Response:
        base = self.config.url(node)
        if base is None and self.config.discovery_job and self.prometheus is not None:
            base = self._discovered(node)
        if base is None:
            raise SidecarError(f"node {node!r} is not a configured sidecar host (sidecars.urls, "
                               "sidecars.nodes, sidecars.node_re or one target of "
                               "sidecars.discovery_job); not contacted")
        url = base.rstrip("/") + path
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise SidecarError(f"sidecar of node {node} ({url}) unreachable: {exc!r}") from exc
        if not response.is_success:
            raise SidecarError(f"sidecar of node {node} answered {method} {path} with HTTP "
                               f"{response.status_code}: {response.text[:300]}")
        return response

    def request_checkpoint(self, node: str, at_step: int | None = None) -> int:
        body = {} if at_step is None else {"at_step": at_step}
        response = self._call("POST", node, "/control/checkpoint", json=body)
        try:
            answer = response.json()
            value = answer["request_id"] if "request_id" in answer else answer["id"]
            # a whole number, as the sidecar counts them: int() would turn 1.5 into another
            # request's id, a bool into 0 or 1, and raise OverflowError on an infinity
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError(value)
            return int(value)
        except (ValueError, KeyError, TypeError) as exc:
            raise SidecarError(f"sidecar of node {node}: checkpoint answer without a request_id: "
                               f"{response.text[:200]}") from exc

    def stacks(self, node: str, timeout_s: float | None = None) -> dict[str, Any]:
        response = self._call("GET", node, "/debug/stacks",
                              timeout=timeout_s or max(self.config.timeout_s, 30.0))
        try:
            data = response.json()
        except ValueError as exc:
            raise SidecarError(f"sidecar of node {node}: stacks are not JSON") from exc
        if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
            raise SidecarError(f"sidecar of node {node}: stacks answer has no `ranks` list")
        data.setdefault("node", node)
        return data

    def selftest(self, node: str, body: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        """The node's self-test report (the sidecar runs `robust-metrics selftest`)."""
        response = self._call("POST", node, "/control/selftest", json=dict(body),
                              timeout=timeout_s)
        try:
            data = response.json()
        except ValueError as exc:
            raise SidecarError(f"sidecar of node {node}: self-test answer is not JSON") from exc
        if not isinstance(data, dict) or data.get("verdict") not in ("pass", "fail", "skipped") \
                or not isinstance(data.get("results"), list):
            raise SidecarError(f"sidecar of node {node}: self-test answer has no verdict and "
                               f"results: {response.text[:200]}")
        return data

    def acknowledged(self, run: str, node: str, request_id: int) -> tuple[bool, str]:
        """Whether every rank of `run` on `node` has handled request `request_id`."""
        if self.config.ack_source == "prometheus":
            sel = f"{{run={promql_string(run)}}}"
            result = self._query(
                f"min by (node) ({ACK_METRIC}{sel} * on(run, rank) group_left(node) "
                f"(max by (run, rank, node) ({INFO_METRIC}{sel})))")
            values = {r["metric"].get("node"): float(r["value"][1]) for r in result}
            if node not in values:
                return False, f"no {ACK_METRIC} for run {run} on node {node} in Prometheus"
            low = values[node]
        else:
            text = self._call("GET", node, "/metrics").text
            acks = [s.value for fam in text_string_to_metric_families(text)
                    for s in fam.samples
                    if s.name == ACK_METRIC and s.labels.get("run") == run]
            if not acks:
                return False, f"sidecar of node {node} shows no {ACK_METRIC} for run {run}"
            low = min(acks)
        if low >= request_id:
            return True, f"node {node}: all ranks acknowledged request {request_id}"
        return False, f"node {node}: slowest rank acknowledged {int(low)}, waiting for {request_id}"
