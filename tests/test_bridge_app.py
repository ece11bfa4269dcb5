"""The bridge in-process: auth, limits, validation, exactly-once, cooldown, budget, actions.

Real HTTP stack (Starlette through its httpx.Client), real SQLite, real local processes and real
HTTP fakes for the sidecar and webhook receivers; Alertmanager is in
integration/test_bridge_alertmanager.py.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import FakeSidecar, Receiver, alert, serve_app, webhook
from tests.support import wait_until

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_config(tmp_path: Path, rules: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"database": str(tmp_path / "bridge.db"), "auth": {"bearer_token": TOKEN},
            "workers": 2, "rules": rules, **extra}


@pytest.fixture
def bridge_client(tmp_path: Path) -> Iterator[Any]:
    """Factory: `start(config_dict)` -> httpx.Client with the engine running; closed at the end."""
    servers: list[Any] = []

    def start(raw: dict[str, Any]) -> httpx.Client:
        bridge = Bridge(parse(raw, tmp_path))
        server = serve_app(create_app(bridge))
        client = server.__enter__()
        client.bridge = bridge  # type: ignore[attr-defined]
        servers.append(server)
        return client

    try:
        yield start
    finally:
        for s in servers:
            s.__exit__(None, None, None)


def post(client: httpx.Client, payload: Any, headers: dict[str, str] | None = None) -> Any:
    return client.post("/api/v1/alerts", content=json.dumps(payload),
                       headers={"Content-Type": "application/json",
                                **(AUTH if headers is None else headers)})


def incidents(client: httpx.Client, **params: str) -> list[dict[str, Any]]:
    r = client.get("/api/v1/actions", params=params, headers=AUTH)
    assert r.status_code == 200, r.text
    return list(r.json()["actions"])


def settled(client: httpx.Client, n: int, **params: str) -> list[dict[str, Any]]:
    final = {"done", "failed", "skipped", "cancelled"}
    return wait_until(lambda: (rows := incidents(client, **params)) and len(rows) >= n and all(
        r["status"] in final for r in rows) and rows, 20, message=f"{n} settled incidents")


# ----------------------------------------------------------------------------- HTTP surface
def test_credentials_required_and_checked(bridge_client: Any, tmp_path: Path) -> None:
    raw = make_config(tmp_path, [{"match": {"alertname": "X"}, "actions": ["dump_stacks"]}])
    raw["auth"]["basic"] = {"username": "am", "password": "pw"}
    client = bridge_client(raw)
    body = webhook(alert("Nothing"))
    assert post(client, body, headers={}).status_code == 401
    assert post(client, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert post(client, body, headers={"Authorization": "Basic !!!"}).status_code == 401
    bad = base64.b64encode(b"am:wrong").decode()
    assert post(client, body, headers={"Authorization": f"Basic {bad}"}).status_code == 401
    good = base64.b64encode(b"am:pw").decode()
    assert post(client, body, headers={"Authorization": f"Basic {good}"}).status_code == 200
    assert post(client, body).status_code == 200
    assert client.get("/api/v1/actions").status_code == 401
    assert client.get("/healthz").status_code == 200
    metrics = client.get("/metrics").text
    assert 'robust_bridge_webhook_requests_total{status="401"} 4.0' in metrics
    assert 'robust_bridge_webhook_requests_total{status="200"} 2.0' in metrics


def test_bad_input_gets_a_4xx_with_a_message(bridge_client: Any, tmp_path: Path) -> None:
    raw = make_config(tmp_path, [{"match": {"alertname": "X"}, "actions": ["dump_stacks"]}],
                      max_body_bytes=2048)
    client = bridge_client(raw)
    r = client.post("/api/v1/alerts", content=b"{not json",
                    headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = post(client, {**webhook(alert()), "version": "3"})
    assert r.status_code == 422 and "version" in r.json()["error"]
    r = post(client, webhook({**alert(), "startsAt": "yesterday"}))
    assert r.status_code == 422 and "alerts[0].startsAt" in r.json()["error"]
    r = post(client, webhook({**alert(), "labels": {"alertname": "X", "n": 3}}))
    assert r.status_code == 422 and "alerts[0].labels.n" in r.json()["error"]
    r = post(client, webhook(alert(big="x" * 4000)))
    assert r.status_code == 413
    r = client.post("/api/v1/alerts", content=b"a=b",
                    headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    assert client.get("/api/v1/actions", params={"limit": "0"}, headers=AUTH).status_code == 400
    # digits to str.isdigit() but not to int() (a superscript, a circled one, 5,000 digits),
    # and non-ASCII digits: a 400, where they raised ValueError (a 500)
    for limit in ("\u00b2", "\u2460", "9" * 5000, "\u0661\u0660"):
        for path in ("/api/v1/actions", "/api/v1/incidents"):
            r = client.get(path, params={"limit": limit}, headers=AUTH)
            assert r.status_code == 400 and "limit" in r.json()["error"], (path, limit)
    assert client.get("/api/v1/actions", params={"stat": "x"}, headers=AUTH).status_code == 400
    assert client.get("/nope").status_code == 404
    assert client.get("/api/v1/alerts").status_code == 405
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.") and "/api/v1/alerts" in spec["paths"]


# ----------------------------------------------------------------------------- exactly once
def test_resent_and_grouped_alerts_act_once(bridge_client: Any, tmp_path: Path) -> None:
    with Receiver() as hook:
        raw = make_config(tmp_path, [{"name": "restart-on-hang",
                                      "match": {"action": "restart"}, "actions": ["restart"]}],
                          schedulers={"hook": {"type": "webhook", "url": hook.url + "/ops",
                                               "secret": "hook-secret"}})
        client = bridge_client(raw)
        a1 = alert("RankHang", fingerprint="aa", run="r1", action="restart")
        r = post(client, webhook(a1))
        assert r.json() == {"accepted": 1, "duplicates": 0, "unmatched": 0, "resolved": 0,
                            "cancelled": 0}
        for _ in range(3):  # Alertmanager's repeat_interval re-sends the same instance
            assert post(client, webhook(a1)).json()["duplicates"] == 1
        a2 = alert("RankHang", fingerprint="bb", run="r2", action="restart")
        assert post(client, webhook(a1, a2)).json()["accepted"] == 1  # grouped with a new one
        rows = settled(client, 2)
        assert sorted(r["run"] for r in rows) == ["r1", "r2"]
        assert {r["status"] for r in rows} == {"done"}
        assert next(r for r in rows if r["run"] == "r1")["notifications"] == 5
        time.sleep(0.5)  # would a late worker act again? It must not.
        bodies = hook.bodies("/ops")
        assert sorted(b["run"] for b in bodies) == ["r1", "r2"]
        assert all(b["operation"] == "restart" for b in bodies)
        assert all(r["signed"] for r in hook.requests), "HMAC signature did not verify"
        keys = [r["headers"]["Idempotency-Key"] for r in hook.requests]
        assert len(set(keys)) == 2
        metrics = client.get("/metrics").text
        assert ('robust_bridge_actions_total{action="restart",result="success",run="r1"} 1.0'
                in metrics)


def test_resolved_cancels_an_instance_waiting_for_its_for_guard(
        bridge_client: Any, tmp_path: Path) -> None:
    with Receiver() as hook:
        raw = make_config(tmp_path, [{"match": {"alertname": "Slow"}, "for": "2s",
                                      "actions": ["notify"]}],
                          notify={"url": hook.url, "secret": "hook-secret"})
        client = bridge_client(raw)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        firing = alert("Slow", fingerprint="s1", run="r1", starts_at=now)
        post(client, webhook(firing))
        resolved = {**firing, "status": "resolved", "endsAt": now}
        assert post(client, webhook(resolved)).json()["cancelled"] == 1
        post(client, webhook(firing))  # a late re-send of the firing instance
        # A resolution seen before its firing (out of order) also blocks it.
        late = alert("Slow", fingerprint="s2", run="r1", starts_at=now)
        post(client, webhook({**late, "status": "resolved", "endsAt": now}))
        post(client, webhook(late))
        # A third instance is not resolved: it acts after its 2s guard, proving the guard runs.
        post(client, webhook(alert("Slow", fingerprint="s3", run="r1", starts_at=now)))
        wait_until(lambda: hook.bodies(), 15, message="the unresolved instance to notify")
        time.sleep(0.5)
        assert [b["incident"].split("@")[0] for b in hook.bodies()] == ["s3"]
        by_fp = {r["fingerprint"]: r["status"] for r in incidents(client)}
        assert by_fp == {"s1": "cancelled", "s2": "cancelled", "s3": "done"}


def test_cooldown_per_run_and_dry_run(bridge_client: Any, tmp_path: Path) -> None:
    with Receiver() as hook:
        raw = make_config(tmp_path, [
            {"name": "page", "match": {"alertname": "Page"}, "cooldown_s": 3600,
             "actions": ["notify"]},
            {"name": "dry", "match": {"alertname": "Dry"}, "dry_run": True,
             "actions": ["notify"]}],
            notify={"url": hook.url, "secret": "hook-secret"})
        client = bridge_client(raw)
        post(client, webhook(alert("Page", fingerprint="p1", run="r1")))
        settled(client, 1)
        post(client, webhook(alert("Page", fingerprint="p2", run="r1")))  # same run: cooldown
        post(client, webhook(alert("Page", fingerprint="p3", run="r2")))  # other run: acts
        post(client, webhook(alert("Dry", fingerprint="d1", run="r3")))
        rows = {r["fingerprint"]: r for r in settled(client, 4)}
        assert rows["p2"]["status"] == "skipped" and "cooldown" in rows["p2"]["reason"]
        assert rows["p3"]["status"] == "done"
        assert rows["d1"]["steps"][0]["status"] == "dry_run"
        assert sorted(b["run"] for b in hook.bodies()) == ["r1", "r2"]


def test_restart_budget_escalates_to_notify(bridge_client: Any, tmp_path: Path) -> None:
    with Receiver() as hook, Receiver() as pager:
        raw = make_config(tmp_path, [{"match": {"action": "restart"}, "actions": ["restart"]}],
                          schedulers={"hook": {"type": "webhook", "url": hook.url}},
                          notify={"url": pager.url}, restart_budget={"max_restarts": 2,
                                                                      "window": "1h"})
        client = bridge_client(raw)
        for i in range(4):
            post(client, webhook(alert("Hang", fingerprint=f"h{i}", run="r1", action="restart")))
        rows = settled(client, 4)
        assert len(hook.bodies()) == 2
        escalations = pager.bodies()
        assert len(escalations) == 2
        assert all(e["escalated_from"] == "restart" for e in escalations)
        assert all("restart budget exhausted" in e["message"] for e in escalations)
        actions = sorted(r["steps"][0]["action"] for r in rows)
        assert actions == ["notify", "notify", "restart", "restart"]


# ----------------------------------------------------------------------------- actions
def test_checkpoint_then_restart_with_local_scheduler(bridge_client: Any,
                                                      tmp_path: Path) -> None:
    starts = tmp_path / "starts.txt"
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\n"
                      f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                      "time.sleep(600)\n")
    with FakeSidecar(node="n1", run="r1", ranks=[0, 1]) as s1, \
            FakeSidecar(node="n2", run="r1", ranks=[2, 3], odd_rank=3) as s2:
        raw = make_config(
            tmp_path, [{"match": {"alertname": "Straggler"}, "scheduler": "local",
                        "actions": ["dump_stacks",
                                    {"type": "restart", "checkpoint_first": True,
                                     "checkpoint_timeout_s": 10}]}],
            sidecars={"urls": {"n1": s1.url, "n2": s2.url}, "token": "side-token",
                      "ack_poll_s": 0.1},
            schedulers={"local": {"type": "local", "command": [sys.executable, str(script)],
                                  "state_dir": str(tmp_path / "state"), "stop_timeout_s": 5}})
        client = bridge_client(raw)
        local = client.bridge.schedulers["local"]
        try:
            local.start("r1")
            wait_until(lambda: starts.exists() and len(starts.read_text().split()) == 1, 10)
            post(client, webhook(alert("Straggler", fingerprint="c1", run="r1", nodes="n1,n2")))
            row = settled(client, 1)[0]
            assert row["status"] == "done", row
            steps = row["steps"]
            assert [s["action"] for s in steps] == ["dump_stacks", "checkpoint", "restart"]
            analysis = steps[0]["data"]["analysis"]
            if analysis is None:  # stack aggregation not installed: raw dumps
                assert sorted(d["node"] for d in steps[0]["data"]["dumps"]) == ["n1", "n2"]
            else:
                assert [(s["rank"], s["node"]) for s in analysis["suspects"]] == [(3, "n2")]
                assert ('robust_hang_suspect{node="n2",rank="3",run="r1"} 1.0'
                        in client.get("/metrics").text)
            assert len(s1.checkpoint_requests) == len(s2.checkpoint_requests) == 1
            assert sorted(steps[1]["data"]["acknowledged"]) == ["n1", "n2"]
            pids = wait_until(lambda: len(p := starts.read_text().split()) == 2 and p, 10)
            assert local.state("r1")["pid"] == int(pids[1])
        finally:
            local.cancel("r1", "test over")


def test_hung_job_restarts_without_asking_for_a_checkpoint(bridge_client: Any,
                                                          tmp_path: Path) -> None:
    with FakeSidecar(node="n1", run="r1", ranks=[0], ack=False) as side, Receiver() as hook:
        raw = make_config(
            tmp_path, [{"match": {"action": "restart"},
                        "actions": [{"type": "restart", "checkpoint_first": True}]}],
            sidecars={"urls": {"n1": side.url}, "token": "side-token"},
            schedulers={"hook": {"type": "webhook", "url": hook.url}})
        client = bridge_client(raw)
        post(client, webhook(alert("RobustRankHang", fingerprint="h", run="r1", node="n1",
                                   action="restart")))
        row = settled(client, 1)[0]
        assert [s["action"] for s in row["steps"]] == ["restart"]
        assert side.checkpoint_requests == []


def test_checkpoint_timeout_fails_the_chain(bridge_client: Any, tmp_path: Path) -> None:
    with FakeSidecar(node="n1", run="r1", ranks=[0], ack=False) as side, Receiver() as hook:
        raw = make_config(
            tmp_path, [{"match": {"alertname": "Ckpt"},
                        "actions": [{"type": "checkpoint", "timeout_s": 0.5}, "notify"]}],
            sidecars={"urls": {"n1": side.url}, "token": "side-token", "ack_poll_s": 0.1},
            notify={"url": hook.url})
        client = bridge_client(raw)
        post(client, webhook(alert("Ckpt", fingerprint="c", run="r1", node="n1")))
        row = settled(client, 1)[0]
        assert row["status"] == "failed"
        assert "not acknowledged" in row["steps"][0]["detail"]
        assert len(row["steps"]) == 1 and hook.bodies() == []


def test_checkpoint_without_sidecars_signals_the_run_through_the_scheduler_once(
        bridge_client: Any, tmp_path: Path) -> None:
    got, starts = tmp_path / "usr1.txt", tmp_path / "starts.txt"
    script = tmp_path / "job.py"
    script.write_text("import os, signal, time\n"
                      f"signal.signal(signal.SIGUSR1, lambda *a: open({str(got)!r}, 'a')"
                      ".write('usr1\\n'))\n"
                      f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                      "while True:\n    time.sleep(0.05)\n")
    raw = make_config(
        tmp_path, [{"match": {"alertname": "Ckpt"}, "actions": ["checkpoint"]}],
        schedulers={"local": {"type": "local", "command": [sys.executable, str(script)],
                              "state_dir": str(tmp_path / "state"), "stop_timeout_s": 5}})
    client = bridge_client(raw)
    local = client.bridge.schedulers["local"]
    try:
        local.start("r1")
        wait_until(lambda: starts.exists() and starts.read_text().strip(), 10)
        for _ in range(2):  # Alertmanager re-sends: still one signal
            post(client, webhook(alert("Ckpt", fingerprint="c", run="r1")))
        row = settled(client, 1)[0]
        assert row["status"] == "done", row
        step = row["steps"][0]
        assert step["data"]["scheduler"] == "local" and step["data"]["signal"] == "SIGUSR1"
        assert "acknowledgement not checked: prometheus.url is not set" in step["detail"]
        wait_until(lambda: got.exists(), 10, message="the job to get SIGUSR1")
        time.sleep(0.3)
        assert got.read_text() == "usr1\n"
    finally:
        local.cancel("r1", "test over")


def test_checkpoint_before_restart_goes_through_the_restarts_scheduler_with_keys(
        bridge_client: Any, tmp_path: Path) -> None:
    with Receiver() as hook:
        raw = make_config(
            tmp_path, [{"match": {"alertname": "Slow"}, "scheduler": "hook",
                        "actions": [{"type": "restart", "checkpoint_first": True}]}],
            schedulers={"hook": {"type": "webhook", "url": hook.url, "secret": "hook-secret"},
                        "other": {"type": "webhook", "url": hook.url + "/other"}},
            default_scheduler="other")
        client = bridge_client(raw)
        post(client, webhook(alert("Slow", fingerprint="s", run="r1")))
        row = settled(client, 1)[0]
        assert row["status"] == "done", row
        assert [s["action"] for s in row["steps"]] == ["checkpoint", "restart"]
        requests = hook.requests
        assert [r["path"] for r in requests] == ["/", "/"]
        assert [(r["body"]["operation"], r["body"].get("signum")) for r in requests] == [
            ("signal", 10), ("restart", None)]
        keys = [r["headers"]["Idempotency-Key"] for r in requests]
        assert keys == [f"{row['key']}#0", f"{row['key']}#1"], (keys, row)
        assert all(r["signed"] for r in requests)


def test_dry_run_checkpoint_names_the_scheduler_and_sends_nothing(bridge_client: Any,
                                                                 tmp_path: Path) -> None:
    with Receiver() as hook:
        raw = make_config(
            tmp_path, [{"match": {"alertname": "Ckpt"}, "dry_run": True,
                        "actions": [{"type": "checkpoint", "scheduler": "hook"}]}],
            sidecars={"urls": {"n1": "http://127.0.0.1:9"}},
            schedulers={"hook": {"type": "webhook", "url": hook.url}})
        client = bridge_client(raw)
        post(client, webhook(alert("Ckpt", fingerprint="d", run="r1", node="n1")))
        step = settled(client, 1)[0]["steps"][0]
        assert step["status"] == "dry_run"
        assert step["detail"] == ("would send SIGUSR1 to run r1 through scheduler hook for a "
                                  "checkpoint")
        assert hook.requests == []


def test_raw_dumps_kept_when_aggregation_is_missing_or_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from robust_metrics.bridge import actions

    dumps = [{"node": "n1", "ranks": [{"rank": 0, "pid": 1, "threads": [], "error": None}]}]
    monkeypatch.setitem(sys.modules, "robust_metrics.analysis.stacks", None)
    assert actions._analyse(dumps) == (None, "stack aggregation not installed; raw dumps stored")
    broken = type(sys)("broken")
    broken.analyse = lambda dumps, info: 1 / 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "robust_metrics.analysis.stacks", broken)
    result, how = actions._analyse(dumps)
    assert result is None and "ZeroDivisionError" in how


def test_hang_suspects_follow_the_latest_analysis_and_run_label_is_required(
        bridge_client: Any, tmp_path: Path) -> None:
    pytest.importorskip("robust_metrics.analysis.stacks")
    with FakeSidecar(node="n1", run="r1", ranks=[0, 1, 2, 3], odd_rank=1) as side:
        raw = make_config(tmp_path, [{"match": {"alertname": "Hang"},
                                      "actions": ["dump_stacks"]}],
                          sidecars={"urls": {"n1": side.url}, "token": "side-token"})
        client = bridge_client(raw)
        post(client, webhook(alert("Hang", fingerprint="a", run="r1", node="n1")))
        settled(client, 1)
        assert 'robust_hang_suspect{node="n1",rank="1",run="r1"} 1.0' in client.get(
            "/metrics").text
        side.odd_rank = 2  # the next dump names another rank; the old series goes away
        post(client, webhook(alert("Hang", fingerprint="b", run="r1", node="n1")))
        settled(client, 2)
        metrics = client.get("/metrics").text
        assert 'robust_hang_suspect{node="n1",rank="2",run="r1"} 1.0' in metrics
        assert 'rank="1",run="r1"' not in metrics
        post(client, webhook(alert("Hang", fingerprint="c", node="n1")))  # no run label
        row = next(r for r in settled(client, 3) if r["fingerprint"] == "c")
        assert row["status"] == "failed" and "`run` label" in row["steps"][0]["detail"]
