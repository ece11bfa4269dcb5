"""Bridge benchmark: 1,000 Alertmanager webhooks at concurrency 20.

Measures the accept latency of POST /api/v1/alerts (the time Alertmanager waits: validation, auth,
one SQLite WAL commit) against GET /healthz on the same server and client as the baseline, then
waits for the actions and checks that every alert instance acted exactly once: 500 distinct
instances are each sent twice, shuffled, so duplicates race each other across connections.
The action is `notify` to a local receiver that counts the Idempotency-Key of every request.

Run: .venv/bin/python bench/bridge.py [--webhooks 1000] [--concurrency 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from robust_metrics import processes  # noqa: E402
from robust_metrics.processes import free_port  # noqa: E402

TOKEN = "bench-token"


class Counting(BaseHTTPRequestHandler):
    keys: Counter[str] = Counter()
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.lock:
            self.keys[self.headers.get("Idempotency-Key", "")] += 1
        self.send_response(204)
        self.end_headers()


def payload(i: int) -> dict[str, object]:
    return {"version": "4", "status": "firing", "receiver": "bridge", "groupKey": f"g{i}",
            "truncatedAlerts": 0, "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://am",
            "alerts": [{"status": "firing", "fingerprint": f"{i:016x}",
                        "labels": {"alertname": "Bench", "run": f"run-{i % 50}",
                                   "rank": str(i)},
                        "annotations": {}, "startsAt": "2026-01-01T00:00:00Z",
                        "endsAt": "0001-01-01T00:00:00Z"}]}


async def fire(url: str, bodies: list[bytes | None], concurrency: int) -> list[float]:
    """Send every body (None: GET /healthz) with `concurrency` in flight; latencies in s."""
    latencies: list[float] = []
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                t0 = time.perf_counter()
                if body is None:
                    r = await client.get("/healthz")
                else:
                    r = await client.post("/api/v1/alerts", content=body, headers=headers)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 10) - 1] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--webhooks", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=20)
    args = parser.parse_args()
    instances = args.webhooks // 2
    serial = 200  # extra instances sent one at a time: the service time without queueing

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-bridge-"))
    port = free_port()
    (tmp / "bridge.yaml").write_text(yaml.safe_dump({
        "database": "bridge.db", "auth": {"bearer_token": TOKEN}, "workers": 4,
        "notify": {"url": f"http://127.0.0.1:{receiver.server_address[1]}"},
        "rules": [{"match": {"alertname": "Bench"}, "actions": ["notify"]}]}))
    service = processes.bridge(tmp / "bridge.yaml", ["--log-level", "warning"], port=port,
                               cwd=ROOT)
    url = service.url
    try:
        service.start(timeout=30)
        asyncio.run(fire(url, [None] * 100, args.concurrency))  # warm-up
        baseline = asyncio.run(fire(url, [None] * args.webhooks, args.concurrency))
        bodies = [json.dumps(payload(i % instances)).encode() for i in range(args.webhooks)]
        random.Random(0).shuffle(bodies)
        t0 = time.perf_counter()
        accept = asyncio.run(fire(url, bodies, args.concurrency))
        sent_s = time.perf_counter() - t0
        while sum(Counting.keys.values()) < instances and time.perf_counter() - t0 < 300:
            time.sleep(0.05)
        drained_s = time.perf_counter() - t0
        one_by_one = asyncio.run(fire(url, [json.dumps(payload(instances + i)).encode()
                                            for i in range(serial)], 1))
        while sum(Counting.keys.values()) < instances + serial and time.perf_counter() - t0 < 300:
            time.sleep(0.05)
        time.sleep(1.0)  # a late duplicate would show up now
        with Counting.lock:
            counts = dict(Counting.keys)
        r = httpx.get(f"{url}/api/v1/actions", params={"limit": "1000"},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        rows = r.json()["actions"]
    finally:
        service.stop(timeout=30)
        receiver.shutdown()

    once = len(counts) == instances + serial and all(v == 1 for v in counts.values())
    notifications = sum(row["notifications"] for row in rows)
    result = {
        "webhooks": args.webhooks, "concurrency": args.concurrency, "instances": instances,
        "accept_p50_ms": round(pct(accept, 50), 2), "accept_p99_ms": round(pct(accept, 99), 2),
        "healthz_p50_ms": round(pct(baseline, 50), 2),
        "healthz_p99_ms": round(pct(baseline, 99), 2),
        "p99_ratio_vs_healthz": round(pct(accept, 99) / pct(baseline, 99), 2),
        "serial_accept_p50_ms": round(pct(one_by_one, 50), 2),
        "serial_accept_p99_ms": round(pct(one_by_one, 99), 2),
        "webhooks_per_s": round(args.webhooks / sent_s, 1),
        "all_acted_s": round(drained_s, 2),
        "actions": sum(counts.values()), "distinct_instances_acted": len(counts),
        "notifications_recorded": notifications, "exactly_once": once,
    }
    print(json.dumps(result, indent=2))
    print(f"\n| webhooks | conc. | accept p50 | accept p99 | healthz p99 | p99 ratio | "
          f"serial p50 / p99 | webhooks/s | all acted after | actions / instances | "
          f"exactly once |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.webhooks} | {args.concurrency} | {result['accept_p50_ms']} ms | "
          f"{result['accept_p99_ms']} ms | {result['healthz_p99_ms']} ms | "
          f"{result['p99_ratio_vs_healthz']}x | {result['serial_accept_p50_ms']} / "
          f"{result['serial_accept_p99_ms']} ms | {result['webhooks_per_s']} | "
          f"{result['all_acted_s']} s | {result['actions']} / {instances + serial} | {once} |")
    ok = once and notifications == args.webhooks + serial
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
