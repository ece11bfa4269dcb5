"""The bridge against a hostile but honest job: labels, payloads and state files it can shape.

A training job sets its own labels (`ROBUST_METRICS_NODE` becomes the `node` label of
`robust_rank_info` and of the alerts built on it), so everything here is what a user of a shared
cluster can send without credentials of the bridge. Real HTTP servers stand in for the attacker.
Discovery from a real Prometheus scrape job: tests/integration/test_bridge_hostile.py.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import yaml

from robust_metrics.bridge.config import SidecarEndpoints, parse
from robust_metrics.sidecar import config as sidecar_config
from tests.bridge_fakes import FakeSidecar, Recorder, StubServer, alert, send_reply, webhook
from tests.served_bridge import AUTH, TOKEN, post, settled, start_bridge
from tests.support import ROOT

__all__ = ["start_bridge"]  # the fixture, imported for pytest


# ----------------------------------------------------------------------------- labels never address
def hostile_nodes(port: int) -> list[str]:
    return [f"127.0.0.1:{port}/steal?x=", f"127.0.0.1:{port}#", f"u@127.0.0.1:{port}/",
            f"127.0.0.1:{port}", f"localhost:{port}/x", "127.0.0.1", "localhost",
            f"n1@127.0.0.1:{port}", f"[::1]:{port}", f"127.0.0.1:{port}\\", "n1/../x",
            f"http://127.0.0.1:{port}/"]


@pytest.mark.parametrize("layout", ["urls only", "template and host set"])
def test_a_node_label_never_receives_the_sidecar_token(start_bridge: Any, layout: str) -> None:
    with Recorder() as evil, FakeSidecar(node="n1", run="r1", ranks=[0]) as side:
        sidecars: dict[str, Any] = {"urls": {"n1": side.url}, "token": "side-token",
                                    "ack_poll_s": 0.05}
        if layout == "template and host set":
            # The template even points at the attacker's port: only the host set protects it.
            sidecars |= {"url_template": f"http://{{node}}:{evil.port}", "node_re": "n[0-9]"}
        client = start_bridge({"sidecars": sidecars, "rules": [
            {"name": "stacks", "match": {"alertname": "Stacks"}, "actions": ["dump_stacks"]},
            {"name": "ckpt", "match": {"alertname": "Ckpt"},
             "actions": [{"type": "checkpoint", "timeout_s": 0.5}]}]})
        nodes = hostile_nodes(evil.port)
        sent = []
        for i, node in enumerate(nodes):
            sent.append(alert("Stacks", fingerprint=f"s{i}", run="r1", node=node))
            sent.append(alert("Ckpt", fingerprint=f"c{i}", run="r1", node=node))
        sent.append(alert("Stacks", fingerprint="mixed", run="r1", nodes=f"n1,{nodes[0]}"))
        assert post(client, webhook(*sent)).status_code == 200
        rows = {r["fingerprint"]: r for r in settled(client, len(sent))}
        assert evil.requests == []
        for i in range(len(nodes)):
            for kind in "sc":
                row = rows[f"{kind}{i}"]
                assert row["status"] == "failed", row
                assert "not a configured sidecar host" in row["steps"][0]["detail"], row
        mixed = rows["mixed"]["steps"][0]
        assert side.stack_requests == 1 and "n1" in mixed["data"]["nodes"]
        assert "not a configured sidecar host" in mixed["data"]["errors"][nodes[0]]


class _CheckpointAnswer(BaseHTTPRequestHandler):
    """A sidecar whose checkpoint answer is the server's `body`, byte for byte."""

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        send_reply(self, 200, self.server.owner.body)  # type: ignore[attr-defined]


@pytest.mark.parametrize("body", [b'{"request_id": 1e999}', b'{"request_id": -Infinity}',
                                  b'{"request_id": NaN}', b'{"request_id": 1.5}',
                                  b'{"request_id": true}', b'{"request_id": [7]}',
                                  b'{"request_id": "7.5"}', b'{"id": null}', b'[]', b'7',
                                  b'{"request_id": 7'])
def test_a_checkpoint_answer_that_is_not_a_whole_request_id_is_a_sidecar_error(
        body: bytes) -> None:
    """The bridge waits for the ranks to acknowledge this id: a fraction would be another
    request's, and an infinity raised OverflowError out of the action."""
    from robust_metrics.bridge.sidecars import SidecarClient, SidecarError

    with StubServer(_CheckpointAnswer) as side:
        side.body = body
        client = SidecarClient(SidecarEndpoints(urls={"n1": side.url}))
        try:
            with pytest.raises(SidecarError, match="without a request_id"):
                client.request_checkpoint("n1")
            side.body = b'{"request_id": "7"}'
            assert client.request_checkpoint("n1") == 7
        finally:
            client.close()


def test_sidecar_url_only_for_configured_hosts() -> None:
    import re

    ends = SidecarEndpoints(url_template="http://{node}:9741", urls={"a:1": "http://x:1"},
                            nodes=frozenset({"gpu-001"}), node_re=re.compile(r"gpu-\d{3}"))
    assert ends.url("gpu-001") == "http://gpu-001:9741"
    assert ends.url("gpu-002") == "http://gpu-002:9741"
    assert ends.url("a:1") == "http://x:1"  # configured verbatim: an exact key, not a pattern
    for name in ("gpu-0011", "gpu-001:80", "gpu-001/", "gpu-001.evil", "", "gpu-001\n",
                 "x@gpu-001", "GPU-001 ", "gpu-001?"):
        assert ends.url(name) is None, name
    assert SidecarEndpoints().url("anything") is None  # no host set: nothing is addressable


def test_url_template_needs_a_host_set() -> None:
    from robust_metrics.bridge.config import ConfigError

    raw = {"auth": {"bearer_token": "t"},
           "rules": [{"match": {"a": "b"}, "actions": ["dump_stacks"]}]}
    with pytest.raises(ConfigError, match=r"sidecars\.nodes or sidecars\.node_re"):
        parse({**raw, "sidecars": {"url_template": "http://{node}:9741"}})
    with pytest.raises(ConfigError, match=r"sidecars\.nodes: expected a list of host names"):
        parse({**raw, "sidecars": {"url_template": "http://{node}:9741", "nodes": ["a:1"]}})
    ok = parse({**raw, "sidecars": {"url_template": "http://{node}:9741", "nodes": ["n1"]}})
    assert ok.sidecars.url("n1") == "http://n1:9741" and ok.sidecars.url("n2") is None


def test_default_sidecar_port_is_the_sidecars() -> None:
    """The bridge's default template, docs/bridge.md and the example policy all use the port the
    sidecar listens on by default."""
    port = sidecar_config.DEFAULT_PORT
    raw = {"auth": {"bearer_token": "t"}, "rules": [{"match": {"a": "b"}, "actions": ["notify"]}],
           "notify": {"url": "http://127.0.0.1:1"}}
    assert parse(raw).sidecars.url_template == f"http://{{node}}:{port}"
    example = yaml.safe_load((ROOT / "examples" / "bridge.yaml").read_text())
    assert example["sidecars"]["url_template"].endswith(f":{port}")
    assert f"`http://{{node}}:{port}`" in (ROOT / "docs" / "bridge.md").read_text()


# ----------------------------------------------------------------------------- the action log
def _filled_log(path: Path, n: int = 300) -> None:
    from robust_metrics.bridge.store import ActionStore, NewAlert

    store = ActionStore(str(path))
    store.accept([NewAlert(f"f{i}", "2026-01-01T00:00:00Z", "r1", "A", {"alertname": "A"}, {},
                           "rule", [{"type": "notify"}], 0.0) for i in range(n)])
    store.close()


def _start_cli(tmp_path: Path, db: Path) -> Any:
    import subprocess
    import sys

    policy = tmp_path / "bridge.yaml"
    policy.write_text(yaml.safe_dump({
        "database": str(db), "auth": {"bearer_token": TOKEN},
        "rules": [{"match": {"alertname": "A"}, "actions": ["dump_stacks"]}]}))
    return subprocess.run([sys.executable, "-m", "robust_metrics", "bridge", "--config",
                           str(policy), "--port", "1"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "zero bytes", "foreign database"])
def test_unusable_action_log_stops_the_start_with_one_line(tmp_path: Path, damage: str) -> None:
    import sqlite3

    db = tmp_path / "bridge.db"
    if damage == "garbage":
        db.write_bytes(b"\x00garbage, not SQLite\n" * 200)
    elif damage == "truncated":
        _filled_log(db)
        data = db.read_bytes()
        db.write_bytes(data[:len(data) // 2])
    elif damage == "zero bytes":
        _filled_log(db)
        db.write_bytes(b"")
    else:
        other = sqlite3.connect(db)
        other.execute("CREATE TABLE notes (x)")
        other.commit()
        other.close()
    before = db.read_bytes()
    out = _start_cli(tmp_path, db)
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # one line, no traceback
    assert str(db) in lines[0] and f"mv {db} {db}.bad" in lines[0], lines[0]
    assert "Traceback" not in out.stderr
    assert db.read_bytes() == before  # refused without touching the evidence


def test_a_log_written_before_the_header_existed_still_opens(tmp_path: Path) -> None:
    """A log from a bridge version without the `meta` row keeps its history."""
    import sqlite3

    from robust_metrics.bridge.store import ActionStore

    db = tmp_path / "old.db"
    _filled_log(db, 3)
    raw = sqlite3.connect(db)
    raw.execute("DROP TABLE meta")
    raw.commit()
    raw.close()
    store = ActionStore(str(db))
    try:
        assert len(store.list(limit=10)) == 3
    finally:
        store.close()
    store = ActionStore(str(tmp_path / "new.db"))  # a path that does not exist: a new log
    store.close()
    # Written beside the path and linked into place: nothing else is left, and it opens again.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("new")) == ["new.db"]
    ActionStore(str(tmp_path / "new.db")).close()


# ----------------------------------------------------------------------------- keys and label text
SPELLINGS = ["2026-01-01T00:00:00.5Z", "2026-01-01T00:00:00.500000000+00:00",
             "2026-01-01T02:00:00.5+02:00", "2025-12-31t19:00:00.50-05:00"]


def test_spellings_of_one_start_time_act_once(start_bridge: Any) -> None:
    from tests.bridge_fakes import Receiver

    with Receiver() as hook:
        client = start_bridge({
            "schedulers": {"hook": {"type": "webhook", "url": hook.url}},
            "rules": [{"match": {"action": "restart"}, "actions": ["restart"]}]})
        for spelling in SPELLINGS:
            r = post(client, webhook(alert("Hang", fingerprint="same", run="r1",
                                           action="restart", starts_at=spelling)))
            assert r.status_code == 200, r.text
        rows = settled(client, 1)
        assert len(rows) == 1 and rows[0]["notifications"] == 4, rows
        assert rows[0]["starts_at"] == "2026-01-01T00:00:00.5Z"
        time.sleep(0.3)  # a second incident would have been claimed by now
        assert len(hook.bodies()) == 1
        # A resolution spelt another way still finds (and here: leaves alone) the same instance.
        r = post(client, webhook(alert("Hang", status="resolved", fingerprint="same", run="r1",
                                       action="restart", starts_at=SPELLINGS[2])))
        assert r.status_code == 200 and len(settled(client, 1)) == 1


def test_canonical_time_is_one_spelling_per_instant() -> None:
    from robust_metrics.bridge.payload import PayloadError, canonical_time, incident_key

    assert {canonical_time(s) for s in SPELLINGS} == {"2026-01-01T00:00:00.5Z"}
    assert canonical_time("2026-01-01T00:00:00.123456789Z") == "2026-01-01T00:00:00.123456789Z"
    assert canonical_time("2026-01-01T00:00:00.123456780Z") == "2026-01-01T00:00:00.12345678Z"
    assert canonical_time("2026-01-01T00:00:00.000Z") == "2026-01-01T00:00:00Z"
    # Instants a nanosecond apart stay apart (Alertmanager keeps nanoseconds).
    assert incident_key("f", "2026-01-01T00:00:00.000000001Z") != incident_key(
        "f", "2026-01-01T00:00:00Z")
    for out_of_range in ("0001-01-01T00:00:00+02:00", "9999-12-31T23:59:59-02:00"):
        with pytest.raises(ValueError):
            canonical_time(out_of_range)
    assert issubclass(PayloadError, ValueError)


def test_a_non_ascii_fingerprint_can_act(start_bridge: Any) -> None:
    from urllib.parse import unquote

    from tests.bridge_fakes import Receiver

    fingerprint = "fé-指纹 \n%"
    with Receiver() as hook:
        client = start_bridge({
            "schedulers": {"hook": {"type": "webhook", "url": hook.url}},
            "rules": [{"match": {"action": "restart"}, "actions": ["restart"]}]})
        post(client, webhook(alert("Hang", fingerprint=fingerprint, run="r1", action="restart")))
        row = settled(client, 1)[0]
        assert row["status"] == "done", row
        [request] = hook.requests
        header = request["headers"]["Idempotency-Key"]
        assert header.isascii() and unquote(header) == f"{row['key']}#0"
        assert row["key"].startswith(fingerprint + "@")


LONE = '"a\\ud800b"'  # JSON text of a string UTF-8 cannot hold


def test_lone_surrogates_in_labels_are_stored_and_returned(start_bridge: Any) -> None:
    client = start_bridge({"rules": [{"match_re": {"alertname": ".*"}, "dry_run": True,
                                      "actions": ["dump_stacks"]}]})
    body = webhook(alert("Odd", fingerprint="x", run="r1", node="n1"))
    text = (json.dumps(body).replace('"x"', LONE).replace('"r1"', LONE)
            .replace('"n1"', LONE).replace('"Odd test"', LONE)
            .replace('"node"', '"n\\udfffode"'))
    r = client.post("/api/v1/alerts", content=text, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 1
    row = settled(client, 1)[0]
    assert row["fingerprint"] == row["run"] == "a\ufffdb"
    assert row["labels"]["n\ufffdode"] == "a\ufffdb"
    r = client.get("/api/v1/actions", headers=AUTH, params={"run": "a\ufffdb"})
    assert r.status_code == 200 and len(r.json()["actions"]) == 1


def test_a_surrogate_stored_by_an_older_bridge_does_not_break_the_audit_trail(
        start_bridge: Any, tmp_path: Path) -> None:
    import sqlite3

    client = start_bridge({"rules": [{"match": {"alertname": "A"}, "actions": ["dump_stacks"]}]})
    db = sqlite3.connect(tmp_path / "bridge.db")
    db.execute("INSERT INTO incidents (key, fingerprint, starts_at, run, alertname, rule, labels, "
               "annotations, plan, status, not_before, received, updated) VALUES "
               "('k', 'f', 't', 'r', 'A', NULL, ?, '{}', '[]', 'ignored', 0, 0, 0)",
               ('{"alertname": "A", "x": "\\ud800"}',))
    db.execute("UPDATE incidents SET status='done' WHERE key='k'")
    db.commit()
    db.close()
    r = client.get("/api/v1/actions", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["actions"][0]["labels"]["x"] == "\ud800"


# ----------------------------------------------------------------------------- one run, one process
def test_local_scheduler_keeps_similar_run_names_apart(tmp_path: Path) -> None:
    """`job 1` and `job_1` are two runs: an alert for one never touches the other's process."""
    import sys

    import psutil

    from robust_metrics.bridge.schedulers.local import LocalScheduler

    local = LocalScheduler({"command": [sys.executable, "-c", "import time; time.sleep(120)"],
                            "state_dir": str(tmp_path / "state"), "stop_timeout_s": 5})
    runs = ["job 1", "job_1"]
    try:
        first = {run: local.start(run).data["pid"] for run in runs}
        assert first["job 1"] != first["job_1"]
        result = local.restart("job 1", "alert for job 1", key="k#0")
        assert result.ok and result.data["stopped_pid"] == first["job 1"]
        assert psutil.pid_exists(first["job_1"]) and local.state("job_1")["pid"] == first["job_1"]
        assert psutil.Process(first["job_1"]).status() != psutil.STATUS_ZOMBIE
        assert local.completed("job 1", "k#0") and not local.completed("job_1", "k#0")
        local.cancel("job_1", "alert for job_1")
        assert local.running("job 1") and not local.running("job_1")
    finally:
        for run in runs:
            local.cancel(run, "test over")
    names = ["job 1", "job_1", "job%201", "job/1", "job\\1", "job.1", "..", "", "x" * 300,
             "x" * 299 + "y", "指纹", "a~b"]
    paths = {local._state_path(n) for n in names}
    assert len(paths) == len(names)
    assert all(p.parent == local.state_dir and len(p.name) < 255 for p in paths)
    # A run named like the cut form of a long name is still another file.
    long = "y" * 300
    assert local._state_path(local._state_path(long).stem) != local._state_path(long)
