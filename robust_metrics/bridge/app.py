"""HTTP routes of the bridge (Starlette): authenticate, limit, validate, hand over to `Bridge`.

Every bad request gets a 4xx with a JSON `{"error": ...}` that says what to fix; the webhook
answers only after the alerts are committed to the action log, so Alertmanager's retry on failure
is the only delivery guarantee needed. Routes:
POST /api/v1/alerts, GET /api/v1/actions, GET /api/v1/incidents (the incident ledger),
GET /api/v1/nodes (incidents per node in the node window), GET /metrics, GET /healthz,
GET /openapi.json.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from robust_metrics.bridge.config import AuthConfig
from robust_metrics.bridge.openapi import spec
from robust_metrics.bridge.payload import PayloadError, parse_notification
from robust_metrics.bridge.service import Bridge
from robust_metrics.numbers import decimal

__all__ = ["create_app"]

log = logging.getLogger(__name__)
STATUSES = ("pending", "running", "done", "failed", "skipped", "cancelled", "ignored")


class HTTPProblem(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class SafeJSONResponse(JSONResponse):
    """UTF-8 JSON, or ASCII-escaped JSON when the content holds text UTF-8 cannot encode (a lone
    surrogate in a label stored by an older bridge): the audit trail stays readable."""

    def render(self, content: object) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return SafeJSONResponse({"error": message}, status_code=status, headers=headers)


def check_auth(auth: AuthConfig, header: str | None) -> None:
    """Raise 401 unless the Authorization header carries the configured bearer token or basic
    credentials (compared in constant time)."""
    challenge = {"WWW-Authenticate": 'Bearer realm="robust-metrics-bridge"'}
    if not header:
        raise HTTPProblem(401, "authorization required (Bearer token or Basic)", challenge)
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and auth.bearer_token:
        if hmac.compare_digest(value.encode(), auth.bearer_token.encode()):
            return
    elif scheme.lower() == "basic" and auth.basic_username and auth.basic_password:
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise HTTPProblem(401, "malformed Basic credentials", challenge) from None
        user_ok = hmac.compare_digest(user.encode(), auth.basic_username.encode())
        password_ok = hmac.compare_digest(password.encode(), auth.basic_password.encode())
        if user_ok and password_ok:
            return
    raise HTTPProblem(401, "invalid credentials", challenge)


def _limit(query: Mapping[str, str]) -> int:
    """The rows a listing asks for: 100 unless `limit` says 1 to 1000."""
    limit = decimal(query.get("limit", "100")) or 0
    if not 1 <= limit <= 1000:
        raise HTTPProblem(400, "limit must be an integer from 1 to 1000")
    return limit


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        declared = decimal(length)
        if declared is None:
            raise HTTPProblem(400, "bad Content-Length header")
        if declared > limit:
            raise HTTPProblem(413, f"body of {length} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPProblem(413, f"body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise HTTPProblem(400, "client disconnected before the body was read") from None
    return b"".join(chunks)


def create_app(bridge: Bridge, *, start_engine: bool = True) -> Starlette:
    """The ASGI app; `start_engine=False` records alerts without acting (tests, benchmarks)."""
    config = bridge.config
    openapi = spec(config.max_body_bytes, config.max_alerts)

    async def alerts(request: Request) -> Response:
        try:
            check_auth(config.auth, request.headers.get("authorization"))
            ctype = request.headers.get("content-type", "application/json").split(";")[0]
            if ctype.strip().lower() != "application/json":
                raise HTTPProblem(415, f"content type {ctype!r}: send application/json")
            body = await _read_body(request, config.max_body_bytes)
            try:
                decoded = json.loads(body)
            except (ValueError, RecursionError) as exc:
                raise HTTPProblem(400, f"body is not valid JSON: {exc}") from None
            try:
                notification = parse_notification(decoded, config.max_alerts)
            except PayloadError as exc:
                raise HTTPProblem(422, str(exc)) from None
            result = await run_in_threadpool(bridge.handle, notification)
            response: Response = SafeJSONResponse(result)
        except HTTPProblem as problem:
            response = _error(problem.status, problem.message, problem.headers)
        except Exception:
            log.exception("webhook failed")
            response = _error(503, "the bridge could not record the alerts; retry")
        bridge.metrics.webhooks.labels(status=str(response.status_code)).inc()
        return response

    async def actions(request: Request) -> Response:
        try:
            q = _query(request, ("run", "status", "limit"))
            status = q.get("status")
            if status is not None and status not in STATUSES:
                raise HTTPProblem(400, f"status must be one of {', '.join(STATUSES)}")
            limit = _limit(q)
        except HTTPProblem as problem:
            return _error(problem.status, problem.message, problem.headers)
        rows = await run_in_threadpool(bridge.store.list, q.get("run"), status, limit)
        return SafeJSONResponse({"actions": [i.to_dict(steps) for i, steps in rows]})

    def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
        check_auth(config.auth, request.headers.get("authorization"))
        q = request.query_params
        unknown = sorted(set(q) - set(allowed))
        if unknown:
            raise HTTPProblem(400, f"unknown query parameter(s) {', '.join(unknown)} "
                              f"(allowed: {', '.join(allowed)})")
        return dict(q)

    async def incidents(request: Request) -> Response:
        try:
            q = _query(request, ("run", "alertname", "limit"))
            limit = _limit(q)
        except HTTPProblem as problem:
            return _error(problem.status, problem.message, problem.headers)
        rows = await run_in_threadpool(bridge.ledger.entries, q.get("run"), q.get("alertname"),
                                       limit)
        return SafeJSONResponse({"incidents": [e.to_dict() for e in rows]})

    async def nodes(request: Request) -> Response:
        try:
            _query(request, ())
        except HTTPProblem as problem:
            return _error(problem.status, problem.message, problem.headers)
        counts = await run_in_threadpool(bridge.ledger.node_counts)
        return SafeJSONResponse({
            "window_s": config.incidents.node_window_s,
            "nodes": [{"node": n, "incidents": c} for n, c in
                      sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]})

    async def metrics(request: Request) -> Response:
        if config.auth.protect_metrics:
            try:
                check_auth(config.auth, request.headers.get("authorization"))
            except HTTPProblem as problem:
                return _error(problem.status, problem.message, problem.headers)
        return Response(generate_latest(bridge.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi)

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no route {request.url.path}; see /openapi.json")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} not allowed on {request.url.path}")

    async def internal(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s: %r", request.method, request.url.path, exc)
        return _error(503, "internal error; the request can be retried")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if start_engine:
            bridge.start()
        try:
            yield
        finally:
            bridge.close()

    app = Starlette(
        routes=[
            Route("/api/v1/alerts", alerts, methods=["POST"]),
            Route("/api/v1/actions", actions, methods=["GET"]),
            Route("/api/v1/incidents", incidents, methods=["GET"]),
            Route("/api/v1/nodes", nodes, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: not_allowed, Exception: internal},
        lifespan=lifespan,
    )
    app.state.bridge = bridge
    return app
