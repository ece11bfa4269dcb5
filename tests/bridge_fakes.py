"""Test doubles for the bridge's neighbours: a node sidecar, a webhook receiver, a bridge process.

The sidecar fake follows the sidecar's contract (POST /control/checkpoint with a bearer token,
GET /debug/stacks, /metrics with robust_checkpoint_request_id per rank) until the real sidecar can
be started in these tests. Alertmanager, amtool and the bridge itself are always real.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from robust_metrics import processes
from robust_metrics.bridge.signing import verify
from tests.support import ROOT, free_port, wait_until


class StubServer:
    """A local HTTP server on a free port answering with `handler`; stopped on exit."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.server.daemon_threads = True
        self.server.owner = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_reply(handler: BaseHTTPRequestHandler, status: int, body: Any,
           ctype: str = "application/json") -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _SidecarHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        fake: FakeSidecar = self.server.owner  # type: ignore[attr-defined]
        if self.headers.get("Authorization") != f"Bearer {fake.token}":
            send_reply(self, 401, {"error": "bad token"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/control/checkpoint":
            send_reply(self, 404, {"error": "no route"})
            return
        with fake.lock:
            fake.next_id += 1
            request_id = fake.next_id
            fake.checkpoint_requests.append(body)
        if fake.ack:
            threading.Timer(fake.ack_delay_s, fake.acknowledge, args=(request_id,)).start()
        send_reply(self, 200, {"request_id": request_id})

    def do_GET(self) -> None:
        fake: FakeSidecar = self.server.owner  # type: ignore[attr-defined]
        if self.path == "/metrics":
            lines = ["# TYPE robust_checkpoint_request_id gauge"]
            lines += [f'robust_checkpoint_request_id{{run="{fake.run}",rank="{r}"}} {fake.acked}'
                      for r in fake.ranks]
            lines += ["# TYPE robust_rank_info gauge"]
            lines += [f'robust_rank_info{{run="{fake.run}",rank="{r}",node="{fake.node}",'
                      f'pid="{1000 + r}"}} 1' for r in fake.ranks]
            send_reply(self, 200, ("\n".join(lines) + "\n").encode(), "text/plain")
            return
        if self.headers.get("Authorization") != f"Bearer {fake.token}":
            send_reply(self, 401, {"error": "bad token"})
            return
        if self.path == "/debug/stacks":
            fake.stack_requests += 1
            send_reply(self, 200, {"node": fake.node, "ranks": [
                {"run": fake.run, "rank": r, "pid": 1000 + r, "error": None,
                 "threads": [{"thread_name": "MainThread", "frames": [
                     {"file": "torch/distributed/distributed_c10d.py", "line": 10,
                      "function": "save_checkpoint" if r == fake.odd_rank else "all_reduce"},
                     {"file": "train.py", "line": 20, "function": "main"}]}]}
                for r in fake.ranks]})
            return
        send_reply(self, 404, {"error": "no route"})


class FakeSidecar(StubServer):
    """A node sidecar: checkpoint requests are acknowledged by every rank after a delay."""

    def __init__(self, *, node: str, run: str, ranks: list[int], token: str = "side-token",
                 ack: bool = True, ack_delay_s: float = 0.3, odd_rank: int | None = None) -> None:
        self.node, self.run, self.ranks, self.token = node, run, ranks, token
        self.odd_rank = odd_rank  # this rank's stack differs: the hang suspect
        self.ack, self.ack_delay_s = ack, ack_delay_s
        self.lock = threading.Lock()
        self.next_id = 1000
        self.acked = 0
        self.checkpoint_requests: list[dict[str, Any]] = []
        self.stack_requests = 0
        super().__init__(_SidecarHandler)

    def acknowledge(self, request_id: int) -> None:
        with self.lock:
            self.acked = max(self.acked, request_id)


class _ReceiverHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        fake: Receiver = self.server.owner  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items()}
        signed = verify(fake.secret, headers, body) if fake.secret else None
        with fake.lock:
            fake.requests.append({"path": self.path, "headers": headers,
                                  "body": json.loads(body), "signed": signed})
        if fake.delay_s:
            time.sleep(fake.delay_s)
        send_reply(self, fake.status, {"ok": fake.status < 300})


class Receiver(StubServer):
    """Records signed JSON POSTs (webhook scheduler, notify); answers `status` after `delay_s`."""

    def __init__(self, secret: str | None = "hook-secret", status: int = 200,
                 delay_s: float = 0.0) -> None:
        self.secret, self.status, self.delay_s = secret, status, delay_s
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        super().__init__(_ReceiverHandler)

    def bodies(self, path: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [r["body"] for r in self.requests if path is None or r["path"] == path]


class _RecorderHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _any(self) -> None:
        fake: Recorder = self.server.owner  # type: ignore[attr-defined]
        with fake.lock:
            fake.requests.append({"method": self.command, "path": self.path,
                                  "headers": dict(self.headers.items())})
        send_reply(self, 200, {"request_id": 1, "node": "evil", "ranks": []})

    do_GET = do_POST = do_PUT = do_DELETE = _any


class Recorder(StubServer):
    """A server that answers everything with 200 and records it: an attacker's listener, to prove
    that nothing (least of all a bearer token) reaches it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        super().__init__(_RecorderHandler)


def alert(alertname: str = "TestAlert", *, status: str = "firing", fingerprint: str = "f1",
          starts_at: str = "2026-01-01T00:00:00.000Z", **labels: str) -> dict[str, Any]:
    return {"status": status, "labels": {"alertname": alertname, **labels},
            "annotations": {"summary": f"{alertname} test"}, "startsAt": starts_at,
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": fingerprint}


def webhook(*alerts: dict[str, Any], status: str | None = None) -> dict[str, Any]:
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0,
            "status": status or alerts[0]["status"] if alerts else "firing",
            "receiver": "bridge", "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://am", "alerts": list(alerts)}


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class BridgeProcess:
    """`python -m robust_metrics bridge` as a real process (so it can be killed with -9)."""

    def __init__(self, config_path: Path, port: int, token: str, log_path: Path) -> None:
        self.port, self.token, self.log_path = port, token, log_path
        self.config_path = config_path
        self.service = processes.bridge(config_path, port=port, log_path=log_path, cwd=ROOT)

    @property
    def url(self) -> str:
        return self.service.url

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.service.proc

    def start(self, timeout: float = 30) -> None:
        self.service.start(timeout)

    def log(self) -> str:
        return self.service.log_tail()

    def kill9(self) -> None:
        proc = self.service.proc
        if proc and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # the bridge only, not what it started
            proc.wait(timeout=10)

    def stop(self) -> None:
        self.service.stop(timeout=15)

    def actions(self, **params: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/actions", params=params,
                      headers={"Authorization": f"Bearer {self.token}"}, timeout=5)
        r.raise_for_status()
        return list(r.json()["actions"])


@contextlib.contextmanager
def bridge_process(config_path: Path, port: int, token: str,
                   log_path: Path) -> Iterator[BridgeProcess]:
    proc = BridgeProcess(config_path, port, token, log_path)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def serve_app(app: Any, port: int | None = None) -> Iterator[httpx.Client]:
    """Serve an ASGI app with uvicorn on a loopback port (`port`, else a free one) in this
    process; yields a client."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        wait_until(lambda: server.started, 20, 0.02, message="uvicorn to start")
        yield client
    finally:
        client.close()
        server.should_exit = True
        thread.join(20)


def run_incident(store: Any, config: Any, alert: Any, now: float) -> float:
    """Accept `alert` into the action log, decide it under `config`'s policy and record every
    step of the plan as succeeded, the incident done: an incident the bridge acted on, as the
    ledger and the NaN guard read it. Returns when its steps succeeded (`now` + 3)."""
    from robust_metrics.bridge.policy import AlertFacts, decide

    store.accept([alert], now=now)
    claimed = store.claim(lambda i, h, at: decide(config, AlertFacts(i.labels, i.starts_at), h,
                                                  at), 3600, now=now + 1)
    assert claimed is not None
    incident, decision = claimed
    for idx, step in enumerate(decision.plan):
        store.start_step(incident.id, idx, step["type"], now=now + 2)
        store.finish_step(incident.id, idx, "success", "ok", {}, now=now + 3)
    store.finish_incident(incident.id, "done", now=now + 4)
    return now + 3

