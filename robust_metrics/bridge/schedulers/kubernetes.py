"""The `kubernetes` scheduler: restart a PyTorchJob or JobSet, cordon a node, record Events.

The run label of a Kubernetes training job is its PyTorchJob (Kubeflow training-operator) or
JobSet name, in one namespace per adapter. What each operation sends to the API server:

| operation  | requests                                                                         |
|------------|----------------------------------------------------------------------------------|
| restart    | GET the job; `delete_pods`: LIST pods by the job's label, DELETE each (the       |
|            | controller recreates them); or `suspend`: PATCH suspend=true, wait until the     |
|            | pods are gone, PATCH suspend=false. Then POST an Event on the job.               |
| drain_node | PATCH the Node: spec.unschedulable=true (what `kubectl cordon` does) and the     |
|            | reason in an annotation; POST an Event on the Node.                              |
| cancel     | GET the job, POST an Event on it, DELETE it (background propagation).           |
| signal     | SIGUSR1 only: LIST the job's pods, PATCH each one's annotations                  |
|            | `robust-metrics.io/checkpoint-request` (a request id) and `...-request-key`.     |

Kubernetes has no API to signal a pod's processes. Its own way to tell a running container
something is an annotation projected into a file by a downward API volume: the kubelet rewrites
the file (within about a minute, its sync period), and the hook, given the file's path
(`ROBUST_METRICS_POD_ANNOTATIONS`), takes a new request id there as one checkpoint request and
acknowledges it in `robust_checkpoint_request_id`, as for SIGUSR1. The same idempotency `key`
sets the same id again (the key is kept beside the id on the pods), so a retried action never
asks for a second checkpoint.

Cordon only: evicting the pods of a synchronous training job one by one would only turn one
failure into many, so the job is restarted by `restart` and the new pods avoid the node.

The Events are what `kubectl describe pytorchjob NAME` shows, so the person on call sees why the
job restarted without opening the bridge's audit log. An Event that cannot be written does not
fail the action (the action happened); its error is in the result's `data`.

Auth is the official client's: in-cluster (the pod's service account) or a kubeconfig file and
context. The least privileges are in deploy/kubernetes/rbac.yaml.

Config::

    schedulers:
      k8s:
        type: kubernetes
        kind: PyTorchJob              # or JobSet
        namespace: training
        auth: auto                    # auto (in-cluster when KUBERNETES_SERVICE_HOST is set),
                                      # in_cluster or kubeconfig
        kubeconfig: ~/.kube/config    # default: $KUBECONFIG or ~/.kube/config
        context: prod                 # default: the current context
        restart_strategy: delete_pods # or suspend
        pod_grace_period_s: 30
"""

from __future__ import annotations

import datetime as dt
import os
import re
import signal as signal_module
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from robust_metrics.bridge.schedulers.base import ActionResult, SchedulerError, check_keys, register
from robust_metrics.configuration import ConfigError
from robust_metrics.numbers import decimal
from robust_metrics.rankfolder.control import (
    CHECKPOINT_ANNOTATION,
    CHECKPOINT_KEY_ANNOTATION,
    new_request_id,
)

__all__ = ["KINDS", "JobKind", "KubernetesScheduler"]

T = TypeVar("T")
COMPONENT = "robust-metrics-bridge"
REASON_ANNOTATION = "robust-metrics.io/cordon-reason"


@dataclass(frozen=True)
class JobKind:
    """Where a training-job kind lives in the API and how its pods and suspend flag are found."""

    kind: str
    group: str
    version: str
    plural: str
    pod_label: str
    suspend_path: tuple[str, ...]


KINDS: dict[str, JobKind] = {
    "PyTorchJob": JobKind("PyTorchJob", "kubeflow.org", "v1", "pytorchjobs",
                          "training.kubeflow.org/job-name", ("spec", "runPolicy", "suspend")),
    "JobSet": JobKind("JobSet", "jobset.x-k8s.io", "v1alpha2", "jobsets",
                      "jobset.sigs.k8s.io/jobset-name", ("spec", "suspend")),
}

_KEYS = {"kind", "namespace", "auth", "kubeconfig", "context", "restart_strategy",
         "pod_grace_period_s", "suspend_timeout_s", "node_event_namespace", "timeout_s",
         "api_version"}
# RFC 1123 names: what the API server accepts for jobs and nodes; checked before any request.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_MESSAGE_MAX = 1024


class KubernetesScheduler:
    """Restart, cancel and annotate training jobs, cordon nodes, through the Kubernetes API."""

    name = "kubernetes"

    def __init__(self, config: Mapping[str, Any], api_client: Any | None = None, *,
                 base_dir: str | Path = ".") -> None:
        """`base_dir`: the folder a relative `kubeconfig` is read from (the policy file's)."""
        check_keys(config, _KEYS, "kubernetes")
        self.base_dir = Path(base_dir)
        kind = str(config.get("kind", "PyTorchJob"))
        if kind not in KINDS:
            raise ConfigError(f"kubernetes scheduler: `kind` is one of {', '.join(KINDS)}, "
                              f"got {kind!r}")
        self.kind = KINDS[kind]
        if config.get("api_version"):  # e.g. jobset.x-k8s.io/v1alpha1 on an older JobSet
            group, _, version = str(config["api_version"]).rpartition("/")
            if group != self.kind.group or not version:
                raise ConfigError(f"kubernetes scheduler: `api_version` must be "
                                  f"{self.kind.group}/<version> for {kind}")
            self.kind = JobKind(**{**self.kind.__dict__, "version": version})
        self.restart_strategy = str(config.get("restart_strategy", "delete_pods"))
        if self.restart_strategy not in ("delete_pods", "suspend"):
            raise ConfigError("kubernetes scheduler: `restart_strategy` is `delete_pods` or "
                              f"`suspend`, got {self.restart_strategy!r}")
        self.grace_period_s = int(_number(config, "pod_grace_period_s", 30, minimum=0))
        self.suspend_timeout_s = _number(config, "suspend_timeout_s", 300, minimum=1)
        self.timeout_s = _number(config, "timeout_s", 30, minimum=1)
        self.node_event_namespace = str(config.get("node_event_namespace", "default"))
        self.api = api_client if api_client is not None else _api_client(config,
                                                                          self.base_dir)
        self.namespace = str(config.get("namespace")
                             or _default_namespace(config, self.base_dir))
        for key, value in (("namespace", self.namespace),
                           ("node_event_namespace", self.node_event_namespace)):
            if not _NAME.match(value):
                raise ConfigError(f"kubernetes scheduler: `{key}` {value!r} is not a valid name")
        from kubernetes import client

        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    # ------------------------------------------------------------------ operations
    def signal(self, run: str, signum: int, *, key: str | None = None) -> ActionResult:
        """Ask every pod of the run for a checkpoint through its annotations (SIGUSR1 only)."""
        if signum != signal_module.SIGUSR1:
            raise SchedulerError(f"kubernetes: only SIGUSR1 (a checkpoint request) reaches a pod, "
                                 f"as the annotation {CHECKPOINT_ANNOTATION}; there is no API to "
                                 f"send signal {signum}")
        _check_name(run, "run")
        pods = self._pod_annotations(run)
        if not pods:
            raise SchedulerError(f"kubernetes: {self.kind.kind} {self.namespace}/{run} has no "
                                 f"pods labelled {self.kind.pod_label}={run} to ask for a "
                                 "checkpoint")
        request_id = _request_id(pods.values(), key)
        values = {CHECKPOINT_ANNOTATION: str(request_id)}
        if key is not None:
            values[CHECKPOINT_KEY_ANNOTATION] = key[:_MESSAGE_MAX]
        annotated = [pod for pod in sorted(pods) if self._annotate(pod, values)]
        if not annotated:
            raise SchedulerError(f"kubernetes: every pod of {self.namespace}/{run} was gone "
                                 "before it could be asked for a checkpoint")
        return ActionResult(True, f"checkpoint request {request_id} set on {len(annotated)} "
                            f"pod(s) of {self.kind.kind} {self.namespace}/{run} "
                            f"({CHECKPOINT_ANNOTATION})",
                            {"pods": annotated, "request_id": request_id})

    def restart(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        job = self._get_job(run)
        restart = self._restart_by_suspend if self.restart_strategy == "suspend" else (
            self._delete_pods)
        pods = restart(run)
        event = self._event(job, "RobustMetricsRestart",
                            f"{_clean(reason)} (restart: {self.restart_strategy}, "
                            f"{len(pods)} pod(s))")
        return ActionResult(True, f"restarted {self.kind.kind} {self.namespace}/{run} by "
                            f"{self.restart_strategy.replace('_', ' ')}: {len(pods)} pod(s)",
                            {"pods": pods, "strategy": self.restart_strategy, **event})

    def drain_node(self, node: str, reason: str, *, key: str | None = None) -> ActionResult:
        _check_name(node, "node")
        text = _clean(reason)
        patch = {"spec": {"unschedulable": True},
                 "metadata": {"annotations": {REASON_ANNOTATION: text}}}
        obj = self._call(f"patch node {node}", lambda: self.core.patch_node(
            node, patch, _content_type="application/strategic-merge-patch+json",
            _request_timeout=self.timeout_s))
        ref = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": obj.metadata.uid}
        event = self._event(ref, "RobustMetricsCordon", text,
                            namespace=self.node_event_namespace)
        return ActionResult(True, f"cordoned node {node}: {text}", {"node": node, **event})

    def cancel(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        job = self._get_job(run)
        event = self._event(job, "RobustMetricsCancel", _clean(reason))
        k = self.kind
        self._call(f"delete {k.kind} {self.namespace}/{run}", lambda: (
            self.custom.delete_namespaced_custom_object(
                k.group, k.version, self.namespace, k.plural, run,
                body={"propagationPolicy": "Background"}, _request_timeout=self.timeout_s)))
        return ActionResult(True, f"deleted {k.kind} {self.namespace}/{run}", event)

    def completed(self, run: str, key: str) -> bool | None:
        """The API server keeps no operation keys: an interrupted restart is failed, not repeated."""
        return None

    def close(self) -> None:
        """Release the client's connection pool (the bridge calls this at shutdown)."""
        self.api.close()

    # ------------------------------------------------------------------ steps
    def _get_job(self, run: str) -> dict[str, Any]:
        _check_name(run, "run")
        k = self.kind
        obj = self._call(f"get {k.kind} {self.namespace}/{run}", lambda: (
            self.custom.get_namespaced_custom_object(
                k.group, k.version, self.namespace, k.plural, run,
                _request_timeout=self.timeout_s)))
        meta = obj.get("metadata") or {}
        return {"apiVersion": f"{k.group}/{k.version}", "kind": k.kind, "name": run,
                "namespace": self.namespace, "uid": meta.get("uid")}

    def _pods(self, run: str) -> list[str]:
        return sorted(self._pod_annotations(run))

    def _pod_annotations(self, run: str) -> dict[str, dict[str, str]]:
        """pod name -> its annotations, for every pod labelled with the run."""
        selector = f"{self.kind.pod_label}={run}"
        pods = self._call(f"list pods {self.namespace} -l {selector}", lambda: (
            self.core.list_namespaced_pod(self.namespace, label_selector=selector,
                                          _request_timeout=self.timeout_s)))
        return {p.metadata.name: dict(p.metadata.annotations or {}) for p in pods.items}

    def _annotate(self, pod: str, values: Mapping[str, str]) -> bool:
        """Merge `values` into the pod's annotations; False when the pod is gone."""
        from kubernetes.client.exceptions import ApiException

        patch = {"metadata": {"annotations": dict(values)}}
        try:
            self.core.patch_namespaced_pod(pod, self.namespace, patch,
                                           _content_type="application/merge-patch+json",
                                           _request_timeout=self.timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise _error(f"patch pod {self.namespace}/{pod}", exc) from None
        except Exception as exc:
            raise _unreachable(exc) from None
        return True

    def _delete_pods(self, run: str) -> list[str]:
        from kubernetes.client.exceptions import ApiException

        pods = self._pods(run)
        if not pods:
            raise SchedulerError(f"kubernetes: {self.kind.kind} {self.namespace}/{run} has no "
                                 f"pods labelled {self.kind.pod_label}={run} to restart")
        for pod in pods:
            try:
                self.core.delete_namespaced_pod(
                    pod, self.namespace, grace_period_seconds=self.grace_period_s,
                    _request_timeout=self.timeout_s)
            except ApiException as exc:
                if exc.status != 404:  # gone already: that is what we wanted
                    raise _error(f"delete pod {self.namespace}/{pod}", exc) from None
            except Exception as exc:
                raise _unreachable(exc) from None
        return pods

    def _restart_by_suspend(self, run: str) -> list[str]:
        pods = self._pods(run)
        self._set_suspend(run, True)
        deadline = time.monotonic() + self.suspend_timeout_s
        try:
            while self._pods(run):
                if time.monotonic() > deadline:
                    raise SchedulerError(f"kubernetes: the pods of {self.namespace}/{run} were "
                                         f"still there {self.suspend_timeout_s:g}s after "
                                         "suspending it; unsuspended it again")
                time.sleep(min(1.0, self.suspend_timeout_s / 10))
        finally:
            self._set_suspend(run, False)
        return pods

    def _set_suspend(self, run: str, value: bool) -> None:
        k = self.kind
        patch: dict[str, Any] = {}
        leaf = patch
        for part in k.suspend_path[:-1]:
            leaf = leaf.setdefault(part, {})
        leaf[k.suspend_path[-1]] = value
        self._call(f"patch {k.kind} {self.namespace}/{run} suspend={value}", lambda: (
            self.custom.patch_namespaced_custom_object(
                k.group, k.version, self.namespace, k.plural, run, patch,
                _content_type="application/merge-patch+json", _request_timeout=self.timeout_s)))

    def _event(self, ref: Mapping[str, Any], reason: str, message: str,
               namespace: str | None = None) -> dict[str, Any]:
        """Record a Warning Event on `ref`; returns {"event": name} or {"event_error": text}."""
        from kubernetes import client

        namespace = namespace or str(ref.get("namespace") or self.namespace)
        now = dt.datetime.now(dt.UTC)
        event = client.CoreV1Event(
            api_version="v1", kind="Event",
            metadata=client.V1ObjectMeta(generate_name=f"{ref['name']}.", namespace=namespace),
            involved_object=client.V1ObjectReference(
                api_version=ref["apiVersion"], kind=ref["kind"], name=ref["name"],
                namespace=ref.get("namespace"), uid=ref.get("uid")),
            reason=reason, message=message[:_MESSAGE_MAX], type="Warning",
            source=client.V1EventSource(component=COMPONENT),
            reporting_component=COMPONENT, reporting_instance=socket.gethostname(),
            first_timestamp=now, last_timestamp=now, count=1)
        try:
            created = self._call(f"create event in {namespace}", lambda: (
                self.core.create_namespaced_event(namespace, event,
                                                  _request_timeout=self.timeout_s)))
        except SchedulerError as exc:
            return {"event_error": str(exc)}
        return {"event": created.metadata.name}

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn()
        except ApiException as exc:
            raise _error(what, exc) from None
        except SchedulerError:
            raise
        except Exception as exc:
            raise _unreachable(exc) from None


# ---------------------------------------------------------------------- helpers
def _api_client(config: Mapping[str, Any], base: Path) -> Any:
    """An ApiClient from the pod's service account or a kubeconfig (never the global default)."""
    from kubernetes import client
    from kubernetes import config as kube_config

    auth = str(config.get("auth", "auto"))
    if auth not in ("auto", "in_cluster", "kubeconfig"):
        raise ConfigError(f"kubernetes scheduler: `auth` is auto, in_cluster or kubeconfig, "
                          f"got {auth!r}")
    if auth == "in_cluster" or (auth == "auto" and os.environ.get("KUBERNETES_SERVICE_HOST")
                                and not config.get("kubeconfig")):
        configuration = client.Configuration()
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException as exc:
            raise ConfigError(f"kubernetes scheduler: in-cluster auth failed: {exc}") from None
        configuration.retries = 1
        return client.ApiClient(configuration)
    path = _kubeconfig_path(config, base)
    if not path.exists():
        raise ConfigError(f"kubernetes scheduler: kubeconfig {path} not found (set `kubeconfig`, "
                          "$KUBECONFIG, or run in a pod with `auth: in_cluster`)")
    try:
        api = kube_config.new_client_from_config(config_file=str(path),
                                                 context=config.get("context"),
                                                 persist_config=False)
    except (kube_config.ConfigException, ValueError, OSError) as exc:
        raise ConfigError(f"kubernetes scheduler: kubeconfig {path}: {exc}") from None
    api.configuration.retries = 1
    return api


def _kubeconfig_path(config: Mapping[str, Any], base: Path) -> Path:
    raw = config.get("kubeconfig") or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or (
        "~/.kube/config")
    return base / Path(str(raw)).expanduser()


def _default_namespace(config: Mapping[str, Any], base: Path) -> str:
    """The namespace of the kubeconfig context, or of the pod's service account, or default."""
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    if str(config.get("auth", "auto")) != "kubeconfig" and sa.exists():
        return sa.read_text().strip()
    try:
        from kubernetes import config as kube_config

        contexts, current = kube_config.list_kube_config_contexts(
            config_file=str(_kubeconfig_path(config, base)))
        chosen = next((c for c in contexts if c["name"] == config.get("context")), current)
        return str((chosen or {}).get("context", {}).get("namespace") or "default")
    except Exception:  # no kubeconfig: in-cluster without a namespace file
        return "default"


def _request_id(pods: Iterable[Mapping[str, str]], key: str | None) -> int:
    """The id a pod already holds for `key` (a retried action), else a new one, newer than any
    id on the pods so the hook, which takes only newer ids, cannot mistake it for an old one."""
    held = []
    for held_by_pod in pods:
        request_id = decimal(held_by_pod.get(CHECKPOINT_ANNOTATION, ""))
        if request_id is not None:
            if key is not None and held_by_pod.get(CHECKPOINT_KEY_ANNOTATION) == key[
                    :_MESSAGE_MAX]:
                return request_id
            held.append(request_id)
    return max([new_request_id(), *(i + 1 for i in held)])


def _check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise SchedulerError(f"kubernetes: {what} {value!r} is not a valid object name "
                             "(lower-case letters, digits, '-', '.')")


def _clean(reason: str) -> str:
    return " ".join(str(reason).split())[:_MESSAGE_MAX] or "robust-metrics"


def _number(config: Mapping[str, Any], key: str, default: float, minimum: float) -> float:
    try:
        value = float(config.get(key, default))
    except (TypeError, ValueError):
        raise ConfigError(f"kubernetes scheduler: `{key}` must be a number") from None
    if value < minimum:
        raise ConfigError(f"kubernetes scheduler: `{key}` must be at least {minimum:g}")
    return value


def _error(what: str, exc: Any) -> SchedulerError:
    import json

    message = ""
    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = str(exc.body or "")[:200]
    hint = {401: " (check the token)", 403: " (RBAC: see deploy/kubernetes/rbac.yaml)",
            404: " (not found)"}.get(int(exc.status or 0), "")
    return SchedulerError(f"kubernetes: {what} failed: {exc.status} {exc.reason}"
                          f"{': ' + message if message else ''}{hint}")


def _unreachable(exc: Exception) -> SchedulerError:
    return SchedulerError(f"kubernetes: cannot reach the API server: {type(exc).__name__}: "
                          f"{str(exc)[:300]}")


@register("kubernetes")
def _factory(config: Mapping[str, Any], base_dir: Path) -> KubernetesScheduler:
    return KubernetesScheduler(config, base_dir=base_dir)
