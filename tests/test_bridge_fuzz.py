"""Fuzz the bridge's HTTP API with hypothesis: whatever arrives, the answer is never a 5xx.

Generated inputs follow the OpenAPI spec's shapes (Alertmanager v4) with any field swapped for
a wrong type, plus arbitrary JSON, arbitrary bytes, odd headers and query strings, sent over real
HTTP to a real uvicorn server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import serve_app

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OK = {200, 400, 401, 413, 415, 422}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    raw = {"database": str(tmp / "bridge.db"), "auth": {"bearer_token": TOKEN},
           "max_body_bytes": 65536, "max_alerts": 50,
           "rules": [{"match_re": {"alertname": ".*"}, "dry_run": True,
                      "actions": ["dump_stacks"]}]}
    with serve_app(create_app(Bridge(parse(raw, tmp)))) as c:
        yield c


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children,
                                                                       max_size=4),
    max_leaves=20)
label_maps = st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=30), max_size=5)
times = st.sampled_from(["2026-01-01T00:00:00Z", "2026-01-01T00:00:00.123456789+02:00",
                         "0001-01-01T00:00:00Z", "not a time", "", "2026-13-45T99:99:99Z"])


def maybe_wrong(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, json_values)


alerts = st.fixed_dictionaries({
    "status": maybe_wrong(st.sampled_from(["firing", "resolved"])),
    "labels": maybe_wrong(label_maps.map(lambda m: {"alertname": "Fuzz", **m})),
    "annotations": maybe_wrong(label_maps),
    "startsAt": maybe_wrong(times),
    "endsAt": maybe_wrong(times),
    "fingerprint": maybe_wrong(st.text(min_size=1, max_size=20)),
}, optional={"generatorURL": st.text(max_size=10), "extra": json_values})
payloads = st.fixed_dictionaries({
    "version": maybe_wrong(st.just("4")),
    "status": maybe_wrong(st.sampled_from(["firing", "resolved"])),
    "alerts": maybe_wrong(st.lists(alerts, max_size=5)),
}, optional={"groupKey": maybe_wrong(st.text()), "truncatedAlerts": maybe_wrong(st.integers()),
             "groupLabels": maybe_wrong(label_maps), "commonLabels": maybe_wrong(label_maps),
             "commonAnnotations": maybe_wrong(label_maps), "receiver": maybe_wrong(st.text())})


@FUZZ
@given(payload=payloads)
def test_structured_payloads_never_5xx(client: httpx.Client, payload: dict[str, Any]) -> None:
    r = client.post("/api/v1/alerts", content=json.dumps(payload), headers=AUTH)
    assert r.status_code in OK, (r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]


@FUZZ
@given(body=st.one_of(json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=300)))
def test_arbitrary_bodies_never_5xx(client: httpx.Client, body: bytes) -> None:
    r = client.post("/api/v1/alerts", content=body, headers=AUTH)
    assert r.status_code in OK, (r.status_code, r.text)


header_text = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1,
                      max_size=40)


@FUZZ
@given(auth=st.one_of(header_text, st.just(f"Bearer {TOKEN}"),
                      header_text.map(lambda t: f"Basic {t}"),
                      header_text.map(lambda t: f"Bearer {t}")),
       ctype=st.one_of(header_text, st.just("application/json; charset=utf-8")),
       query=st.dictionaries(st.sampled_from(["run", "status", "limit", "x"]), header_text,
                             max_size=3))
def test_headers_and_queries_never_5xx(client: httpx.Client, auth: str, ctype: str,
                                       query: dict[str, str]) -> None:
    r = client.post("/api/v1/alerts", content=b'{"version": "4"}',
                    headers={"Authorization": auth, "Content-Type": ctype})
    assert r.status_code in OK, (r.status_code, r.text)
    r = client.get("/api/v1/actions", params=query, headers={"Authorization": auth})
    assert r.status_code in {200, 400, 401}, (r.status_code, r.text)
