"""Fuzz the bridge's HTTP API with hypothesis: whatever arrives, the answer is never a 5xx.

Generated inputs follow the OpenAPI spec's shapes (Alertmanager v4) with any field swapped for
a wrong type, plus arbitrary JSON, arbitrary bytes, odd headers and query strings, sent over real
HTTP to a real uvicorn server. Text includes lone surrogates (valid JSON escapes that UTF-8
cannot hold) and start times in many spellings; after every example the audit trail must still
answer 200.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
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
# Any text, lone surrogates included (hypothesis leaves them out unless asked).
any_text = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=30)
label_maps = st.dictionaries(any_text.filter(bool), any_text, max_size=5)
times = st.one_of(
    st.sampled_from(["2026-01-01T00:00:00Z", "2026-01-01T00:00:00.123456789+02:00",
                     "0001-01-01T00:00:00Z", "0001-01-01T00:00:00+02:00",
                     "9999-12-31T23:59:59-02:00", "not a time", "", "2026-13-45T99:99:99Z",
                     "2026-01-01t00:00:00.5z", "2026-01-01 00:00:00,5+00:00"]),
    st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat()))


def maybe_wrong(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, json_values)


alerts = st.fixed_dictionaries({
    "status": maybe_wrong(st.sampled_from(["firing", "resolved"])),
    "labels": maybe_wrong(label_maps.map(lambda m: {"alertname": "Fuzz", **m})),
    "annotations": maybe_wrong(label_maps),
    "startsAt": maybe_wrong(times),
    "endsAt": maybe_wrong(times),
    "fingerprint": maybe_wrong(any_text.filter(bool)),
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
    r = client.get("/api/v1/actions", params={"limit": "5"}, headers=AUTH)
    assert r.status_code == 200, r.text


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


instants = st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1),
                        timezones=st.timezones())
valid_alerts = st.fixed_dictionaries({
    "status": st.just("firing"),
    "labels": label_maps.map(lambda m: {**m, "alertname": "Fuzz"}),
    "annotations": label_maps,
    "fingerprint": any_text.filter(bool),
})


@FUZZ
@given(alert=valid_alerts, start=instants, offset_minutes=st.integers(-1439, 1439),
       digits=st.integers(0, 9))
def test_any_label_text_is_stored_and_any_spelling_of_the_start_is_one_instance(
        client: httpx.Client, alert: dict[str, Any], start: datetime, offset_minutes: int,
        digits: int) -> None:
    """Valid v4 alerts with any text: 200, stored, listed; the same instance re-sent with its
    start time in another zone and precision is a duplicate, never a second instance."""
    first = {**alert, "startsAt": start.isoformat()}
    zone = timezone(timedelta(minutes=offset_minutes))
    fraction = f"{start.microsecond:06d}{'0' * digits}"
    other = start.astimezone(zone).replace(microsecond=0).isoformat(timespec="seconds")
    second = {**alert, "startsAt": f"{other[:19]}.{fraction}{other[19:]}"}
    for sent, field in ((first, "accepted"), (second, "duplicates")):
        r = client.post("/api/v1/alerts", headers=AUTH, content=json.dumps(
            {"version": "4", "status": "firing", "alerts": [sent]}))
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.json()[field] + (r.json()["duplicates"] if field == "accepted" else 0) == 1, (
            sent, r.json())
    r = client.get("/api/v1/actions", params={"limit": "1000"}, headers=AUTH)
    assert r.status_code == 200, r.text
