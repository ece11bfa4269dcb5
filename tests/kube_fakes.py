"""A local HTTP server that speaks the Kubernetes API paths the `kubernetes` scheduler adapter uses.

No cluster runs in CI, so `FakeKubeAPI` checks what a real API server would: each request's
method and path against the published REST paths (core/v1 pods, nodes, events; the PyTorchJob and
JobSet custom resources), its Content-Type against the patch type the resource accepts (custom
resources take no strategic merge patch), its body against the client's own models, and the
bearer token. It keeps just enough state (jobs, pods, nodes, events) to check the outcome, and a
toy controller that removes a job's pods when it is suspended. A request a real server would
reject is answered 400 and recorded in `violations`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from kubernetes import client as k8s

from robust_metrics.bridge.schedulers.kubernetes import KINDS, KubernetesScheduler
from tests.support import free_port

__all__ = ["MERGE", "NS", "STRATEGIC", "TOKEN", "FakeKubeAPI", "adapter", "go_quote", "kubeconfig",
           "kubelet_write"]

TOKEN = "test-token-" + uuid.uuid4().hex[:8]
NS = "training"
CUSTOM = re.compile(r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/"
                    r"(?P<plural>[^/]+)/(?P<name>[^/]+)$")
PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods$")
POD = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)$")
NODE = re.compile(r"^/api/v1/nodes/(?P<name>[^/]+)$")
EVENTS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/events$")
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class FakeKubeAPI:
    """A threaded HTTP server answering the handful of API paths the adapter may use."""

    def __init__(self, tls: tuple[Path, Path] | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.jobs: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, str]] = {}  # (ns, name) -> labels
        self.pod_annotations: dict[tuple[str, str], dict[str, str]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.forbid: set[str] = set()  # "create events" etc.: answered 403 as RBAC would
        self.controller = True  # remove a job's pods while it is suspended
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api._handle(self, "GET")

            def do_POST(self) -> None:
                api._handle(self, "POST")

            def do_PATCH(self) -> None:
                api._handle(self, "PATCH")

            def do_DELETE(self) -> None:
                api._handle(self, "DELETE")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        scheme = "http"
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    # ------------------------------------------------------------------ state
    def add_job(self, kind: str, name: str, pods: int, ns: str = NS) -> str:
        k = KINDS[kind]
        uid = str(uuid.uuid4())
        spec: dict[str, Any] = {"runPolicy": {"suspend": False}} if kind == "PyTorchJob" else {
            "suspend": False}
        self.jobs[(k.plural, ns, name)] = {
            "apiVersion": f"{k.group}/{k.version}", "kind": kind,
            "metadata": {"name": name, "namespace": ns, "uid": uid}, "spec": spec}
        for i in range(pods):
            self.pods[(ns, f"{name}-worker-{i}")] = {k.pod_label: name}
        return uid

    def annotations_file(self, pod: str, ns: str = NS) -> bytes:
        """The pod's downward API `metadata.annotations` file as the kubelet writes it: sorted
        `key="value"` lines, values quoted as Go's %q does."""
        return "".join(f"{k}={go_quote(v)}\n" for k, v in sorted(
            self.pod_annotations.get((ns, pod), {}).items())).encode()

    def add_node(self, name: str) -> str:
        uid = str(uuid.uuid4())
        self.nodes[name] = {"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": name, "uid": uid, "annotations": {}},
                            "spec": {}}
        return uid

    # ------------------------------------------------------------------ HTTP
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        record = {"method": method, "path": parts.path, "query": parse_qs(parts.query),
                  "content_type": (h.headers.get("Content-Type") or "").split(";")[0],
                  "body": json.loads(raw) if raw else None}
        with self.lock:
            self.requests.append(record)
            scheme, _, token = (h.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or token != TOKEN:  # the scheme is case-insensitive
                return self._send(h, 401, _status(401, "Unauthorized", "Unauthorized"))
            try:
                code, body = self._route(record)
            except AssertionError as exc:  # a request a real server would reject
                self.violations.append(f"{method} {h.path}: {exc}")
                code, body = 400, _status(400, "BadRequest", str(exc))
        self._send(h, code, body)

    def _send(self, h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _route(self, r: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        method, path, body = r["method"], r["path"], r["body"]
        if m := CUSTOM.match(path):
            k = next((k for k in KINDS.values() if k.plural == m["plural"]), None)
            assert k and m["group"] == k.group and m["version"] == k.version, "unknown resource"
            key = (m["plural"], m["ns"], m["name"])
            verb = {"GET": "get", "PATCH": "patch", "DELETE": "delete"}.get(method)
            assert verb, f"{method} is not a verb of a custom object"
            if f"{verb} {m['plural']}" in self.forbid:
                return 403, _status(403, "Forbidden", f"cannot {verb} {m['plural']}")
            if key not in self.jobs:
                return 404, _status(404, "NotFound", f'{m["plural"]} "{m["name"]}" not found')
            job = self.jobs[key]
            if method == "GET":
                assert body is None, "GET with a body"
                return 200, job
            if method == "PATCH":
                assert r["content_type"] == MERGE, (
                    f"custom resources accept JSON merge patches, not {r['content_type']}")
                assert isinstance(body, dict), "a merge patch is a JSON object"
                _merge(job, body)
                suspended = job["spec"].get("suspend") if k.kind == "JobSet" else (
                    job["spec"].get("runPolicy", {}).get("suspend"))
                if suspended and self.controller:
                    for pod in [p for p, labels in self.pods.items()
                                if p[0] == m["ns"] and labels.get(k.pod_label) == m["name"]]:
                        del self.pods[pod]
                return 200, job
            k8s.V1DeleteOptions.from_dict(body or {})
            del self.jobs[key]
            return 200, _status(200, "", "deleted", status="Success")
        if m := PODS.match(path):
            assert method == "GET", f"{method} on the pod collection"
            selector = r["query"].get("labelSelector", [""])[0]
            assert re.fullmatch(r"[\w./-]+=[\w.-]+", selector), f"bad selector {selector!r}"
            key, value = selector.split("=")
            items = [{"metadata": {"name": name, "namespace": ns, "labels": labels,
                                   "annotations": self.pod_annotations.get((ns, name), {})}}
                     for (ns, name), labels in sorted(self.pods.items())
                     if ns == m["ns"] and labels.get(key) == value]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        if (m := POD.match(path)) and method == "PATCH":
            assert r["content_type"] in (STRATEGIC, MERGE), f"patch type {r['content_type']}"
            assert isinstance(body, dict) and set(body) == {"metadata"}, (
                "the adapter patches nothing of a pod but its metadata")
            values = body["metadata"].get("annotations")
            assert isinstance(values, dict) and all(
                isinstance(v, str) for v in values.values()), "annotation values are strings"
            if (m["ns"], m["name"]) not in self.pods:
                return 404, _status(404, "NotFound", f'pods "{m["name"]}" not found')
            self.pod_annotations.setdefault((m["ns"], m["name"]), {}).update(values)
            return 200, {"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": m["name"], "namespace": m["ns"],
                                      "annotations": self.pod_annotations[(m["ns"], m["name"])]}}
        if m := POD.match(path):
            assert method == "DELETE", f"{method} on a pod"
            options = k8s.V1DeleteOptions.from_dict(body or {})
            assert options.grace_period_seconds is not None or "gracePeriodSeconds" in r[
                "query"], "pods are deleted with an explicit grace period"
            if (m["ns"], m["name"]) not in self.pods:
                return 404, _status(404, "NotFound", f'pods "{m["name"]}" not found')
            del self.pods[(m["ns"], m["name"])]
            self.pod_annotations.pop((m["ns"], m["name"]), None)
            return 200, {"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": m["name"], "namespace": m["ns"]}}
        if m := NODE.match(path):
            assert method == "PATCH", f"{method} on a node"
            assert r["content_type"] in (STRATEGIC, MERGE), f"patch type {r['content_type']}"
            assert isinstance(body, dict), "a strategic merge patch is a JSON object"
            if m["name"] not in self.nodes:
                return 404, _status(404, "NotFound", f'nodes "{m["name"]}" not found')
            _merge(self.nodes[m["name"]], body)
            return 200, self.nodes[m["name"]]
        if m := EVENTS.match(path):
            assert method == "POST", f"{method} on events"
            if "create events" in self.forbid:
                return 403, _status(403, "Forbidden", "cannot create events")
            event = k8s.CoreV1Event.from_dict(body)
            meta = body.get("metadata", {})
            assert meta.get("namespace") in (None, m["ns"]), "event namespace differs from URL"
            assert event.involved_object.uid, "events need the involved object's uid"
            assert body.get("type") in ("Normal", "Warning"), "event type"
            assert event.reason and event.message, "event reason and message"
            obj = dict(body)
            obj["metadata"] = {**meta, "name": meta.get("generateName", "") + uuid.uuid4().hex[:5],
                               "namespace": m["ns"]}
            self.events.append(obj)
            return 201, obj
        raise AssertionError("not a path the adapter should use")


def kubelet_write(folder: Path, name: str, data: bytes) -> None:
    """Update a downward API volume as the kubelet's atomic writer does: the files go into a new
    timestamped folder, `..data` is switched to it by renaming a link, the old folder goes, and
    `name` is a link through `..data`."""
    folder.mkdir(parents=True, exist_ok=True)
    version = folder / f"..{uuid.uuid4().hex}"
    version.mkdir()
    (version / name).write_bytes(data)
    data_link, old = folder / "..data", None
    if data_link.is_symlink():
        old = folder / os.readlink(data_link)
    tmp = folder / "..data_tmp"
    os.symlink(version.name, tmp)
    os.replace(tmp, data_link)
    if not (folder / name).is_symlink():
        os.symlink(f"..data/{name}", folder / name)
    if old is not None:
        shutil.rmtree(old)


def go_quote(value: str) -> str:
    """Go's strconv.Quote: printable characters as they are, the rest escaped."""
    simple = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
              "\t": "\\t", "\v": "\\v", "\\": "\\\\", '"': '\\"'}
    out = []
    for ch in value:
        if ch in simple:
            out.append(simple[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _status(code: int, reason: str, message: str, status: str = "Failure") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "status": status, "message": message,
            "reason": reason, "code": code}


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch (for these bodies, strategic merge does the same)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def kubeconfig(tmp_path: Path, url: str, token: str = TOKEN, namespace: str = NS) -> Path:
    """A kubeconfig whose current context reaches `url` with `token` in `namespace`."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "bridge", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "bridge",
                                                   "namespace": namespace}}]}))
    return path


def adapter(tmp_path: Path, api: FakeKubeAPI, **config: Any) -> KubernetesScheduler:
    """The `kubernetes` adapter, through a kubeconfig, against `api`; short timeouts."""
    return KubernetesScheduler({"auth": "kubeconfig", "kubeconfig": str(
        kubeconfig(tmp_path, api.url)), "timeout_s": 5, "suspend_timeout_s": 5, **config})
