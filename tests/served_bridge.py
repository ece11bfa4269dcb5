"""A bridge served over real HTTP in this process, its engine running (`start_bridge`, a fixture
factory: a module imports it to use it), alerts posted to it, and the wait for its incidents to
settle: the hostile-job tests in tests/test_bridge_hostile.py and
tests/integration/test_bridge_hostile.py share them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import serve_app
from tests.support import wait_until

TOKEN = "hostile-tests-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
FINAL = {"done", "failed", "skipped", "cancelled"}


@pytest.fixture
def start_bridge(tmp_path: Path) -> Iterator[Any]:
    """Factory: `start(raw_policy)` -> httpx.Client of a served bridge with its engine running."""
    servers: list[Any] = []

    def start(raw: dict[str, Any]) -> httpx.Client:
        raw = {"database": str(tmp_path / "bridge.db"), "auth": {"bearer_token": TOKEN},
               "workers": 2, **raw}
        server = serve_app(create_app(Bridge(parse(raw, tmp_path))))
        client = server.__enter__()
        servers.append(server)
        return client

    try:
        yield start
    finally:
        for s in servers:
            s.__exit__(None, None, None)


def post(client: httpx.Client, payload: Any) -> httpx.Response:
    return client.post("/api/v1/alerts", content=json.dumps(payload), headers=AUTH)


def settled(client: httpx.Client, n: int) -> list[dict[str, Any]]:
    def rows() -> list[dict[str, Any]] | None:
        r = client.get("/api/v1/actions", headers=AUTH)
        assert r.status_code == 200, r.text
        got = r.json()["actions"]
        return got if len(got) >= n and all(i["status"] in FINAL for i in got) else None

    return list(wait_until(rows, 30, message=f"{n} settled incidents"))
