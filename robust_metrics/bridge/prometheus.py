"""The bridge's Prometheus client: instant queries, the scrape targets and their metadata.

The bridge reads Prometheus for the nodes of a run (`robust_rank_info`), checkpoint
acknowledgements, its own stop notice, the crash-loop guard's highest step and the incident
ledger, and finds sidecars among the targets Prometheus scrapes (`sidecars.discovery_job`). It is
a client of its own, apart from the sidecars': it carries no sidecar token.
"""

from __future__ import annotations

from typing import Any

import httpx

from robust_metrics import schema

__all__ = ["ACK_METRIC", "INFO_METRIC", "PrometheusClient", "PrometheusError", "promql_string"]

ACK_METRIC = schema.get("robust_checkpoint_request_id").name
INFO_METRIC = schema.get("robust_rank_info").name


class PrometheusError(RuntimeError):
    """Prometheus could not be reached or gave an unusable answer."""


def promql_string(value: str) -> str:
    """`value` as a PromQL string literal (any label text, quoted and escaped)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class PrometheusClient:
    """The HTTP API of one Prometheus (`prometheus.url`)."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str, params: dict[str, str], what: str) -> Any:
        try:
            return self._http.get(f"{self.url}{path}", params=params).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusError(f"Prometheus {what}: {exc!r}") from exc

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, evaluated now or at unix time `at`."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        body = self._get("/api/v1/query", params, "query failed")
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error", body) if isinstance(body, dict) else body
            raise PrometheusError(f"Prometheus refused {promql!r}: {error}")
        return list(body["data"]["result"])

    def active_targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (`labels`, `scrapeUrl`, `health`, ...)."""
        body = self._get("/api/v1/targets", {"state": "active"}, "targets unreadable")
        try:
            active = body["data"]["activeTargets"]
        except (KeyError, TypeError) as exc:
            raise PrometheusError(f"Prometheus targets unreadable: {exc!r}") from exc
        return [t for t in active if isinstance(t, dict)] if isinstance(active, list) else []

    def scraped(self, metric: str) -> bool:
        """Whether any target Prometheus scrapes exposes `metric`: Prometheus keeps the metadata
        (HELP and TYPE) of every metric its active targets expose, present from their first
        scrape even while the metric has no series yet."""
        body = self._get("/api/v1/targets/metadata", {"metric": metric},
                         "target metadata unreadable")
        if not isinstance(body, dict) or body.get("status") != "success" or not isinstance(
                body.get("data"), list):
            raise PrometheusError(f"Prometheus target metadata unreadable: {str(body)[:200]}")
        return bool(body["data"])

    def checkpoint_ids(self, run: str) -> dict[str, float]:
        """rank -> newest checkpoint request id the rank acknowledged, for every rank of the run
        Prometheus knows (from its info series; 0 for a rank that never acknowledged one)."""
        sel = f"{{run={promql_string(run)}}}"
        result = self.query(f"max by (rank) ({ACK_METRIC}{sel}) or on(rank) "
                            f"(0 * max by (rank) ({INFO_METRIC}{sel}))")
        return {r["metric"]["rank"]: float(r["value"][1]) for r in result
                if "rank" in r.get("metric", {})}
