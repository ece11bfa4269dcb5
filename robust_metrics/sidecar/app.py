"""HTTP routes of the sidecar; the work lives in the collectors, `rank_files` and `stacks`.

- `GET /metrics`: every enabled collector (Prometheus text or OpenMetrics, gzip when asked).
- `GET /healthz`: 200 while the process serves; never behind authentication.
- `GET /debug/stacks[?native=1&locals=1&run=R&rank=N&timeout=S]`: py-spy dumps of the rank
  processes as JSON (bearer token).
- `POST /control/checkpoint[?at_step=N]` (or a JSON body `{"at_step": N}`): asks the ranks to run
  their checkpoint callback at the next step boundary (bearer token); answers 202 with the request id
  that the ranks acknowledge in `robust_checkpoint_request_id`.
- `POST /control/selftest` (optional JSON body `{"quick": true, "checks": ["compute"],
  "expect_digest": "...", "fleet_median_flops": 1e12}`): runs `robust-metrics selftest` as a
  subprocess (bearer token; one at a time, 429 while one runs; 504 when it outlives
  `--selftest-timeout`), answers 200 with its report and publishes it as `robust_selftest_*`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from robust_metrics.numbers import rank_order
from robust_metrics.rankfolder import control
from robust_metrics.rankfolder.identity import RankIdentity
from robust_metrics.rankfolder.proof import prove_rank
from robust_metrics.sidecar import selftest as selftest_runner
from robust_metrics.sidecar.auth import TokenFile, WebConfig
from robust_metrics.sidecar.collectors.registry import ScrapeRegistry
from robust_metrics.sidecar.collectors.selftest import SelftestCollector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class BadRequest(ValueError):
    pass


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "").lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise BadRequest(f"{name}={value!r}: use 1/0 or true/false")


def _number(value: Any, name: str, kind: type = int, minimum: float = 0,
            maximum: float = math.inf) -> Any:
    """A query or body number in [minimum, maximum); an integer is a JSON integer or decimal
    digits (int() would make step 1.5 step 1 and raise OverflowError on 1e999)."""
    if value is None:
        return None
    not_a = f"{name}={value!r} is not a{'n integer' if kind is int else ' number'}"
    if isinstance(value, bool) or (kind is int and isinstance(value, float)):
        raise BadRequest(not_a)
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(not_a) from None
    if not math.isfinite(number) or not minimum <= number < maximum:
        upper = "" if maximum == math.inf else f" and < {maximum:g}"
        raise BadRequest(f"{name}={value!r}: must be a finite number >= {minimum}{upper}")
    return number


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_app(config: SidecarConfig, registry: ScrapeRegistry, folder: RankFiles, *,
               token: TokenFile | None = None, web: WebConfig | None = None,
               on_close: Callable[[], None] | None = None,
               selftest: SelftestCollector | None = None) -> Starlette:
    """The sidecar's Starlette app; `on_close` runs at shutdown (collector threads, locks);
    `selftest` publishes the reports of `POST /control/selftest` (None: answered, not published)."""
    prom_registry = CollectorRegistry(auto_describe=False)
    prom_registry.register(registry)  # type: ignore[arg-type]
    basic = web.basic_auth if web else None
    stack_slot = threading.Semaphore(1)
    selftest_slot = threading.Semaphore(1)

    def bearer_denied(request: Request) -> Response | None:
        if token is None:
            return _error(403, "disabled: start the sidecar with --token-file to enable "
                               f"{request.url.path}")
        if not token.check(request.headers.get("authorization")):
            return _error(401, "a valid 'Authorization: Bearer <token>' header is required",
                          {"WWW-Authenticate": 'Bearer realm="robust-metrics"'})
        return None

    async def metrics(request: Request) -> Response:
        if basic is not None and not await run_in_threadpool(
                basic.check, request.headers.get("authorization")):
            return PlainTextResponse("unauthorized\n", status_code=401,
                                     headers={"WWW-Authenticate": 'Basic realm="robust-metrics"'})
        encoder, content_type = choose_encoder(request.headers.get("accept"))

        def encode() -> bytes:
            with folder.one_scrape():  # every collector of this scrape reads the same state
                return encoder(prom_registry)

        body = await run_in_threadpool(encode)
        headers = {}
        if "gzip" in request.headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        return Response(body, media_type=content_type, headers=headers)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def index(request: Request) -> Response:
        return PlainTextResponse(
            "robust-metrics sidecar\n/metrics\n/healthz\n/debug/stacks (bearer token)\n"
            "/control/checkpoint (POST, bearer token)\n/control/selftest (POST, bearer token)\n")

    async def stacks(request: Request) -> Response:
        denied = bearer_denied(request)
        if denied is not None:
            return denied
        try:
            native = _flag(request, "native")
            locals_ = _flag(request, "locals")
            timeout = _number(request.query_params.get("timeout"), "timeout", float, 0.1)
            rank_filter = request.query_params.get("rank")
            run_filter = request.query_params.get("run")
        except BadRequest as exc:
            return _error(400, str(exc))
        try:
            from robust_metrics.sidecar import stacks as stacks_module
        except ImportError as exc:
            return _error(501, f"stack dumps are not available in this build: {exc}")
        snapshot = await run_in_threadpool(folder.snapshot)
        ranks = {pid: ident for pid, ident in snapshot.identities.items()
                 if snapshot.alive.get(pid)
                 and (rank_filter is None or ident.rank == rank_filter)
                 and (run_filter is None or ident.run == run_filter)}
        if not stack_slot.acquire(blocking=False):
            return _error(429, "a stack dump is already running; retry in a few seconds")
        try:
            out = await run_in_threadpool(
                _dump_proven, stacks_module.dump_stacks, config.directory, ranks,
                native=native, locals_=locals_, timeout=min(timeout or config.stacks_timeout, 60.0))
        finally:
            stack_slot.release()
        out.sort(key=lambda e: (e["run"], rank_order(e["rank"])))
        return JSONResponse({"node": config.node, "ranks": out})

    async def checkpoint(request: Request) -> Response:
        denied = bearer_denied(request)
        if denied is not None:
            return denied
        try:
            body: dict[str, Any] = {}
            raw = await request.body()
            if raw.strip():
                try:
                    body = json.loads(raw)
                except ValueError:
                    raise BadRequest("the body must be JSON, e.g. {\"at_step\": 1200}") from None
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                unknown = set(body) - {"at_step"}
                if unknown:
                    raise BadRequest(f"unknown field(s) {', '.join(sorted(unknown))}; "
                                     "supported: at_step")
            # the hook refuses a request whose step a float64 metric cannot hold exactly
            at_step = _number(body.get("at_step", request.query_params.get("at_step")),
                              "at_step", maximum=control.MAX_REQUEST_ID)
        except BadRequest as exc:
            return _error(400, str(exc))
        snapshot = await run_in_threadpool(folder.snapshot)
        ranks = sorted(((i.run, i.rank, pid) for pid, i in snapshot.identities.items()
                        if snapshot.alive.get(pid)), key=lambda r: (r[0], rank_order(r[1])))
        try:
            req = await run_in_threadpool(control.write_checkpoint_request, config.directory,
                                          None, at_step)
        except OSError as exc:
            return _error(503, f"cannot write the checkpoint request: {exc}")
        log.info("checkpoint request %d (at_step=%s) for %d rank(s)", req.id, at_step, len(ranks))
        return JSONResponse({"request_id": req.id, "at_step": req.at_step, "node": config.node,
                             "ranks": [{"run": r, "rank": k, "pid": p} for r, k, p in ranks]},
                            status_code=202)

    async def run_selftest(request: Request) -> Response:
        denied = bearer_denied(request)
        if denied is not None:
            return denied
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            return _error(400, "the body must be JSON, e.g. {\"quick\": true}")
        try:
            wanted = selftest_runner.parse_request(body)
        except ValueError as exc:
            return _error(400, str(exc))
        if not selftest_slot.acquire(blocking=False):
            return _error(429, "a self-test is already running on this node; retry when it ends")
        argv = selftest_runner.command(config.node, wanted, config.selftest_args)
        try:
            report = await run_in_threadpool(selftest_runner.run_selftest, argv,
                                             config.selftest_timeout)
        except selftest_runner.SelftestTimeout as exc:
            return _error(504, str(exc))
        except (selftest_runner.SelftestError, OSError) as exc:
            return _error(503, f"the self-test could not run: {exc}")
        finally:
            selftest_slot.release()
        if selftest is not None:
            selftest.publish(report)
        log.info("self-test of node %s: %s%s", config.node, report.verdict,
                 f" (failed: {', '.join(report.failed)})" if report.failed else "")
        return JSONResponse(report.to_dict())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if on_close is not None:
            on_close()

    routes = [
        Route("/", index),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/debug/stacks", stacks),
        Route("/control/checkpoint", checkpoint, methods=["POST"]),
        Route("/control/selftest", run_selftest, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _dump_proven(dump_stacks: Callable[..., list[dict[str, Any]]], directory: str,
                 ranks: dict[int, RankIdentity], *, native: bool, locals_: bool,
                 timeout: float) -> list[dict[str, Any]]:
    """Stack dumps of the ranks proven to be ranks of this folder; an error entry for the others.

    Each entry carries the rank's identity and topology (as in `ranks/<pid>.json`, except `node`,
    which is the sidecar's own name for its node and is set by the caller).
    """
    refused = {pid: prove_rank(directory, ident) for pid, ident in ranks.items()}
    proven = sorted(pid for pid, reason in refused.items() if reason is None)
    dumps = {int(d["pid"]): d for d in dump_stacks(proven, native=native, locals_=locals_,
                                                   timeout=timeout)} if proven else {}
    out = []
    for pid, ident in ranks.items():
        entry: dict[str, Any] = {k: v for k, v in ident.labels().items() if k != "node"}
        entry.update(dumps.get(pid) or {"pid": pid, "threads": [], "error": refused[pid]})
        out.append(entry)
    return out
