"""The `kubernetes` adapter against a local HTTP server that speaks the Kubernetes API's paths.

No cluster runs in CI: `tests/kube_fakes.py`'s `FakeKubeAPI` checks each request as a real API
server would (paths, patch types, bodies against the client's models, the bearer token) and keeps
just enough state to check the outcome.

The shipped RBAC manifest is validated with the client's models, and checked against the
requests the adapter made: every request allowed, every verb granted used.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")
from kubernetes import client as k8s

from robust_metrics.bridge.schedulers import base
from robust_metrics.bridge.schedulers.kubernetes import (
    KINDS,
    REASON_ANNOTATION,
    KubernetesScheduler,
)
from robust_metrics.rankfolder.control import CHECKPOINT_ANNOTATION, CHECKPOINT_KEY_ANNOTATION
from tests.kube_fakes import MERGE, NS, STRATEGIC, TOKEN, FakeKubeAPI, adapter, kubeconfig
from tests.support import ROOT, free_port, require_binary

RBAC = ROOT / "deploy" / "kubernetes" / "rbac.yaml"


# ---------------------------------------------------------------------- fixtures
@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    server = FakeKubeAPI()
    try:
        yield server
    finally:
        server.close()
    assert not server.violations, server.violations


# ---------------------------------------------------------------------- operations
def test_restart_pytorchjob_deletes_its_pods_and_records_an_event(tmp_path: Path,
                                                                   api: FakeKubeAPI) -> None:
    uid = api.add_job("PyTorchJob", "llama-7b", pods=3)
    api.add_job("PyTorchJob", "other", pods=1)
    k = adapter(tmp_path, api)
    assert k.namespace == NS  # from the kubeconfig context
    result = k.restart("llama-7b", "robust-metrics bridge: StepHang on run llama-7b [a#0]")
    assert result.ok
    assert result.data["pods"] == [f"llama-7b-worker-{i}" for i in range(3)]
    assert sorted(name for _, name in api.pods) == ["other-worker-0"]
    [event] = api.events
    assert event["involvedObject"] == {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                       "name": "llama-7b", "namespace": NS, "uid": uid}
    assert event["reason"] == "RobustMetricsRestart" and event["type"] == "Warning"
    assert "StepHang on run llama-7b" in event["message"]
    assert event["metadata"]["namespace"] == NS and result.data["event"] == event["metadata"][
        "name"]
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("GET", f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs/llama-7b"),
        ("GET", f"/api/v1/namespaces/{NS}/pods"),
        *[("DELETE", f"/api/v1/namespaces/{NS}/pods/llama-7b-worker-{i}") for i in range(3)],
        ("POST", f"/api/v1/namespaces/{NS}/events")]
    assert api.requests[1]["query"]["labelSelector"] == ["training.kubeflow.org/job-name=llama-7b"]
    assert all(r["query"]["gracePeriodSeconds"] == ["30"] for r in api.requests[2:5])
    k.close()


@pytest.mark.parametrize(("kind", "path"), [("JobSet", ("spec", "suspend")),
                                            ("PyTorchJob", ("spec", "runPolicy", "suspend"))])
def test_restart_by_suspend_toggles_the_flag_after_the_pods_are_gone(
        tmp_path: Path, api: FakeKubeAPI, kind: str, path: tuple[str, ...]) -> None:
    api.add_job(kind, "gpt", pods=2)
    k = adapter(tmp_path, api, kind=kind, restart_strategy="suspend")
    result = k.restart("gpt", "HangDetected")
    assert result.ok and result.data["pods"] == ["gpt-worker-0", "gpt-worker-1"]
    patches = [r for r in api.requests if r["method"] == "PATCH"]
    assert [r["content_type"] for r in patches] == [MERGE, MERGE]
    bodies = []
    for r in patches:
        value: Any = r["body"]
        for part in path:
            value = value[part]
        bodies.append(value)
    assert bodies == [True, False]
    plural = KINDS[kind].plural
    job = api.jobs[(plural, NS, "gpt")]
    assert (job["spec"]["suspend"] if kind == "JobSet" else job["spec"]["runPolicy"][
        "suspend"]) is False
    # the pods were listed again (gone) between suspending and resuming
    methods = [(r["method"], r["path"].rsplit("/", 1)[-1]) for r in api.requests]
    assert methods.index(("PATCH", "gpt")) < methods.index(("GET", "pods"), 2) < len(
        methods) - 1 - methods[::-1].index(("PATCH", "gpt"))
    assert api.events[0]["involvedObject"]["kind"] == kind


def test_suspend_that_does_not_stop_the_pods_resumes_and_fails(tmp_path: Path,
                                                               api: FakeKubeAPI) -> None:
    api.add_job("JobSet", "stuck", pods=1)
    api.controller = False  # no controller acts on the suspend flag
    k = adapter(tmp_path, api, kind="JobSet", restart_strategy="suspend", suspend_timeout_s=1)
    with pytest.raises(base.SchedulerError, match="still there 1s after suspending"):
        k.restart("stuck", "x")
    assert api.jobs[("jobsets", NS, "stuck")]["spec"]["suspend"] is False


def test_drain_node_cordons_it_and_records_the_reason(tmp_path: Path, api: FakeKubeAPI) -> None:
    uid = api.add_node("gpu-node-7")
    k = adapter(tmp_path, api)
    result = k.drain_node("gpu-node-7", "robust-metrics bridge: GpuXidError\n on run x")
    assert result.ok and result.data["node"] == "gpu-node-7"
    node = api.nodes["gpu-node-7"]
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"][REASON_ANNOTATION] == (
        "robust-metrics bridge: GpuXidError on run x")
    patch = api.requests[0]
    assert (patch["method"], patch["path"], patch["content_type"]) == (
        "PATCH", "/api/v1/nodes/gpu-node-7", STRATEGIC)
    [event] = api.events
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-7",
                                       "uid": uid}
    assert event["reason"] == "RobustMetricsCordon"


def test_cancel_records_an_event_then_deletes_the_job(tmp_path: Path, api: FakeKubeAPI) -> None:
    api.add_job("JobSet", "run-3", pods=2)
    k = adapter(tmp_path, api, kind="JobSet")
    assert k.cancel("run-3", "LossNaN on run-3").ok
    assert ("jobsets", NS, "run-3") not in api.jobs
    assert [r["method"] for r in api.requests] == ["GET", "POST", "DELETE"]
    assert api.requests[2]["body"] == {"propagationPolicy": "Background"}
    assert api.events[0]["involvedObject"]["apiVersion"] == "jobset.x-k8s.io/v1alpha2"


def test_an_event_that_cannot_be_written_does_not_fail_the_action(tmp_path: Path,
                                                                  api: FakeKubeAPI) -> None:
    api.add_job("PyTorchJob", "j", pods=1)
    api.forbid.add("create events")
    result = adapter(tmp_path, api).restart("j", "x")
    assert result.ok and not api.pods
    assert "403" in result.data["event_error"] and "rbac.yaml" in result.data["event_error"]


def test_signal_sets_the_checkpoint_annotation_on_every_pod_once_per_key(
        tmp_path: Path, api: FakeKubeAPI) -> None:
    api.add_job("PyTorchJob", "llama-7b", pods=3)
    api.add_job("PyTorchJob", "other", pods=1)
    k = adapter(tmp_path, api)
    before = time.time_ns() // 1_000_000
    first = k.signal("llama-7b", signal.SIGUSR1, key="inc-1#0")
    pods = [f"llama-7b-worker-{i}" for i in range(3)]
    assert first.ok and first.data["pods"] == pods
    request_id = first.data["request_id"]
    assert request_id >= before
    for pod in pods:
        assert api.pod_annotations[(NS, pod)] == {CHECKPOINT_ANNOTATION: str(request_id),
                                                  CHECKPOINT_KEY_ANNOTATION: "inc-1#0"}
    assert (NS, "other-worker-0") not in api.pod_annotations
    patches = [r for r in api.requests if r["method"] == "PATCH"]
    assert [r["path"] for r in patches] == [f"/api/v1/namespaces/{NS}/pods/{p}" for p in pods]
    assert {r["content_type"] for r in patches} == {MERGE}

    # the same key (a retried step, a bridge restarted mid-action) sets the same id again
    again = k.signal("llama-7b", signal.SIGUSR1, key="inc-1#0")
    assert again.data["request_id"] == request_id
    assert {a[CHECKPOINT_ANNOTATION] for a in api.pod_annotations.values()} == {str(request_id)}
    # a new key is a new request, newer than the one the pods hold even if the clock is behind
    api.pod_annotations[(NS, pods[1])][CHECKPOINT_ANNOTATION] = str(request_id + 10**9)
    newer = k.signal("llama-7b", signal.SIGUSR1, key="inc-2#0")
    assert newer.data["request_id"] == request_id + 10**9 + 1
    assert {a[CHECKPOINT_ANNOTATION] for a in api.pod_annotations.values()} == {
        str(request_id + 10**9 + 1)}
    # without a key every call is a new request
    assert k.signal("llama-7b", signal.SIGUSR1).data["request_id"] > newer.data["request_id"]


def test_a_pod_annotation_that_is_no_request_id_is_not_held(tmp_path: Path,
                                                            api: FakeKubeAPI) -> None:
    """The pods' annotations are the job's to change: a value int() refuses (over 4,300
    digits) or no id could be (a '²') is ignored, and the new request is still newer than the
    valid id another pod holds."""
    api.add_job("PyTorchJob", "j", pods=3)
    held = time.time_ns() // 1_000_000 + 10**9
    for i, raw in enumerate(("9" * 5000, "²", str(held))):
        api.pod_annotations[(NS, f"j-worker-{i}")] = {CHECKPOINT_ANNOTATION: raw}
    result = adapter(tmp_path, api).signal("j", signal.SIGUSR1, key="inc-1#0")
    assert result.ok and result.data["request_id"] == held + 1


def test_signal_skips_a_pod_that_is_gone_and_fails_when_all_are(tmp_path: Path,
                                                                api: FakeKubeAPI) -> None:
    api.add_job("JobSet", "gpt", pods=2)
    k = adapter(tmp_path, api, kind="JobSet")
    real_patch = k.core.patch_namespaced_pod

    def patch_after_delete(name: str, *args: Any, **kwargs: Any) -> Any:
        api.pods.pop((NS, name), None)  # deleted between the LIST and the PATCH
        return real_patch(name, *args, **kwargs)

    k.core.patch_namespaced_pod = patch_after_delete  # type: ignore[method-assign]
    with pytest.raises(base.SchedulerError, match=r"every pod .* was gone"):
        k.signal("gpt", signal.SIGUSR1, key="a#0")
    api.add_job("JobSet", "gpt", pods=2)
    k.core.patch_namespaced_pod = real_patch  # type: ignore[method-assign]
    api.pods.pop((NS, "gpt-worker-0"))
    assert k.signal("gpt", signal.SIGUSR1, key="a#0").data["pods"] == ["gpt-worker-1"]


# ---------------------------------------------------------------------- errors
def test_errors_name_the_object_and_the_cause(tmp_path: Path, api: FakeKubeAPI) -> None:
    k = adapter(tmp_path, api)
    with pytest.raises(base.SchedulerError, match=r"get PyTorchJob training/nope failed: 404"):
        k.restart("nope", "x")
    api.add_job("PyTorchJob", "nopods", pods=0)
    with pytest.raises(base.SchedulerError, match="has no pods labelled"):
        k.restart("nopods", "x")
    api.forbid.add("delete pytorchjobs")
    with pytest.raises(base.SchedulerError, match=r"403 .*RBAC"):
        k.cancel("nopods", "x")
    with pytest.raises(base.SchedulerError, match="404"):
        k.drain_node("no-such-node", "x")
    with pytest.raises(base.SchedulerError, match="has no pods labelled"):
        k.signal("nopods", signal.SIGUSR1)
    with pytest.raises(base.SchedulerError, match="there is no API to send signal"):
        k.signal("nopods", signal.SIGTERM)
    sent = len(api.requests)
    for bad in ("Upper", "a b", "../x", "", "x" * 300):
        with pytest.raises(base.SchedulerError, match="not a valid object name"):
            k.restart(bad, "x")
        with pytest.raises(base.SchedulerError, match="not a valid object name"):
            k.drain_node(bad, "x")
        with pytest.raises(base.SchedulerError, match="not a valid object name"):
            k.signal(bad, signal.SIGUSR1)
    assert len(api.requests) == sent  # refused before any request


def test_wrong_token_and_unreachable_server(tmp_path: Path, api: FakeKubeAPI) -> None:
    wrong = KubernetesScheduler({"auth": "kubeconfig", "kubeconfig": str(
        kubeconfig(tmp_path, api.url, token="wrong"))})
    with pytest.raises(base.SchedulerError, match=r"401 .*check the token"):
        wrong.drain_node("n1", "x")
    down = KubernetesScheduler({"auth": "kubeconfig", "timeout_s": 2, "kubeconfig": str(
        kubeconfig(tmp_path, f"http://127.0.0.1:{free_port()}"))})
    with pytest.raises(base.SchedulerError, match="cannot reach the API server"):
        down.drain_node("n1", "x")


@pytest.mark.parametrize(("config", "message"), [
    ({"kind": "TFJob"}, "`kind` is one of"),
    ({"restart_strategy": "evict"}, "`restart_strategy`"),
    ({"auth": "token"}, "`auth` is auto"),
    ({"namespace": "Bad_NS"}, "not a valid name"),
    ({"timeout_s": 0}, "at least"),
    ({"pod_grace_period_s": "soon"}, "must be a number"),
    ({"api_version": "kubeflow.org/"}, "api_version"),
    ({"kubeconfig": "/nonexistent/kubeconfig"}, "not found"),
    ({"namespaces": "x"}, "unknown key"),
])
def test_bad_config_is_rejected(tmp_path: Path, api: FakeKubeAPI, config: dict[str, Any],
                                message: str) -> None:
    full = {"auth": "kubeconfig", "kubeconfig": str(kubeconfig(tmp_path, api.url)), **config}
    with pytest.raises(ValueError, match=message):
        KubernetesScheduler(full)


def test_registry_and_api_version_override(tmp_path: Path, api: FakeKubeAPI) -> None:
    k = base.create("kubernetes", {"auth": "kubeconfig", "kind": "JobSet",
                                   "api_version": "jobset.x-k8s.io/v1alpha1",
                                   "kubeconfig": str(kubeconfig(tmp_path, api.url))})
    assert isinstance(k, KubernetesScheduler) and isinstance(k, base.Scheduler)
    assert k.kind.version == "v1alpha1" and KINDS["JobSet"].version == "v1alpha2"


@pytest.fixture
def tls_pair(tmp_path: Path) -> tuple[Path, Path]:
    openssl = require_binary("openssl")
    cert, key = tmp_path / "ca.crt", tmp_path / "tls.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    return cert, key


def test_in_cluster_auth_uses_the_service_account(tmp_path: Path, tls_pair: tuple[Path, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import kubernetes.config.incluster_config as incluster

    server = FakeKubeAPI(tls=tls_pair)
    try:
        (tmp_path / "token").write_text(TOKEN)
        monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster, "SERVICE_CERT_FILENAME", str(tls_pair[0]))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", server.url.rsplit(":", 1)[1])
        uid = server.add_node("n1")
        k = KubernetesScheduler({"namespace": NS})  # auth: auto, in a pod
        assert k.drain_node("n1", "x").ok
        assert server.nodes["n1"]["spec"]["unschedulable"] is True
        assert server.events[0]["involvedObject"]["uid"] == uid
        assert not server.violations
    finally:
        server.close()


# ---------------------------------------------------------------------- manifests
MODELS = {"ServiceAccount": k8s.V1ServiceAccount, "ClusterRole": k8s.V1ClusterRole,
          "ClusterRoleBinding": k8s.V1ClusterRoleBinding, "Role": k8s.V1Role,
          "RoleBinding": k8s.V1RoleBinding}


def _manifests() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(RBAC.read_text()) if d]


def test_rbac_manifest_is_valid_for_the_client_models() -> None:
    docs = _manifests()
    assert {d["kind"] for d in docs} == set(MODELS)
    for doc in docs:
        model = MODELS[doc["kind"]].from_dict(doc)  # required fields, types
        # round trip: a misspelt or misplaced field would be dropped and show up here
        assert k8s.ApiClient().sanitize_for_serialization(model) == doc


def _granted(sa: tuple[str, str]) -> list[tuple[str | None, dict[str, Any]]]:
    """(namespace or None for cluster-wide, rule) for every rule bound to the service account."""
    docs = _manifests()
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}
    grants = []
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and (s["namespace"], s["name"]) == sa
                   for s in b["subjects"]):
            continue
        ns = b["metadata"].get("namespace") if b["kind"] == "RoleBinding" else None
        ref = b["roleRef"]
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        grants += [(ns, rule) for rule in role["rules"]]
    return grants


def _attributes(r: dict[str, Any]) -> tuple[str, str, str, str | None]:
    """(apiGroup, resource, verb, namespace) of a request, as the RBAC authorizer sees it."""
    parts = r["path"].strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    ns = None
    if rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    named = len(rest) > 1
    verb = {"GET": "get" if named else "list", "POST": "create", "PATCH": "patch",
            "DELETE": "delete" if named else "deletecollection"}[r["method"]]
    return group, rest[0], verb, ns


def test_rbac_allows_every_request_and_grants_nothing_unused(tmp_path: Path,
                                                              api: FakeKubeAPI) -> None:
    for kind in KINDS:
        api.add_job(kind, f"{kind.lower()}-a", pods=2)
        api.add_job(kind, f"{kind.lower()}-b", pods=2)
        api.add_job(kind, f"{kind.lower()}-c", pods=1)
        for strategy, name in (("delete_pods", "a"), ("suspend", "b")):
            k = adapter(tmp_path, api, kind=kind, restart_strategy=strategy)
            assert k.restart(f"{kind.lower()}-{name}", "x").ok
        assert k.signal(f"{kind.lower()}-c", signal.SIGUSR1, key="k#0").ok
        assert k.cancel(f"{kind.lower()}-c", "x").ok
    api.add_node("n1")
    assert adapter(tmp_path, api).drain_node("n1", "x").ok

    grants = _granted(("robust-metrics", "robust-metrics-bridge"))
    used: set[tuple[str, str, str]] = set()
    for r in api.requests:
        group, resource, verb, ns = _attributes(r)
        allowed = [
            (g_ns, rule) for g_ns, rule in grants
            if group in rule["apiGroups"] and resource in rule["resources"]
            and verb in rule["verbs"] and (g_ns is None or g_ns == ns)]
        assert allowed, f"rbac.yaml does not allow {verb} {group}/{resource} in {ns}"
        used.add((group, resource, verb))
    granted = {(g, res, v) for _, rule in grants for g in rule["apiGroups"]
               for res in rule["resources"] for v in rule["verbs"]}
    assert granted - used == set(), f"granted but never used: {granted - used}"
    # the Role that holds the job verbs is namespaced to the training namespace
    assert {ns for ns, rule in grants if "pods" in rule["resources"]} == {NS}
    # Events may only be written in namespaces, never cluster-wide
    assert all(ns is not None for ns, rule in grants if "events" in rule["resources"])


def test_docs_policy_example_is_accepted_by_the_bridge_and_both_adapters(tmp_path: Path) -> None:
    from robust_metrics.bridge import config as bridge_config
    from robust_metrics.bridge.schedulers.slurm import SlurmScheduler

    text = (ROOT / "docs" / "schedulers.md").read_text()
    policy = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    parsed = bridge_config.parse({**policy, "auth": {"bearer_token": "x"}}, tmp_path)
    slurm, kube = parsed.schedulers["cluster"], parsed.schedulers["k8s"]
    assert (slurm.type, kube.type) == ("slurm", "kubernetes")
    assert isinstance(base.create(slurm.type, slurm.options), SlurmScheduler)
    k = KubernetesScheduler(kube.options, api_client=k8s.ApiClient())
    assert (k.kind.plural, k.namespace) == ("pytorchjobs", "training")
