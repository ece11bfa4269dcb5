"""Nodes and checkpoint acknowledgements read from a real Prometheus.

Without sidecars, a checkpoint is SIGUSR1 through the scheduler; with Prometheus the bridge waits
until every rank of the run shows a newer `robust_checkpoint_request_id` than before the signal.

An alert without a `node` label: the bridge asks Prometheus (`robust_rank_info`) where the run's
ranks are, asks those sidecars for a checkpoint, and waits until Prometheus has scraped every
rank's `robust_checkpoint_request_id` at or above the request id (`ack_source: prometheus`).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from robust_metrics.bridge.app import create_app
from robust_metrics.bridge.config import parse
from robust_metrics.bridge.service import Bridge
from tests.bridge_fakes import FakeSidecar, alert, serve_app, webhook
from tests.prometheus_fixture import PrometheusServer, wait_for_series
from tests.support import EXAMPLE, free_port, rank_job, wait_until

TOKEN = "prom-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def checkpoint_until_settled(client: httpx.Client, run: str) -> dict[str, Any]:
    """Post a `Ckpt` alert for `run` and wait until its checkpoint action is done or failed."""
    r = client.post("/api/v1/alerts", json=webhook(alert("Ckpt", run=run)), headers=AUTH)
    assert r.status_code == 200, r.text
    return wait_until(lambda: (a := client.get("/api/v1/actions", headers=AUTH).json()[
        "actions"]) and a[0]["status"] in ("done", "failed") and a[0], 45,
        message="the checkpoint to be acknowledged")


def test_checkpoint_with_nodes_and_acks_from_prometheus(tmp_path: Path) -> None:
    with FakeSidecar(node="n1", run="r1", ranks=[0, 1], ack_delay_s=1.0) as s1, \
            FakeSidecar(node="n2", run="r1", ranks=[2, 3], ack_delay_s=1.0) as s2, \
            FakeSidecar(node="n3", run="other", ranks=[0]) as s3:
        targets = [u.removeprefix("http://") for u in (s1.url, s2.url, s3.url)]
        with PrometheusServer(tmp_path / "prom", targets, job="sidecars") as prom:
            url = prom.url
            wait_until(lambda: prom.query("count(robust_rank_info) == 5"), 60,
                       message="Prometheus to scrape the sidecars")
            raw = {"database": str(tmp_path / "b.db"), "auth": {"bearer_token": TOKEN},
                   "prometheus": {"url": url},
                   "sidecars": {"urls": {"n1": s1.url, "n2": s2.url, "n3": s3.url},
                                "token": "side-token", "ack_source": "prometheus",
                                "ack_poll_s": 0.5},
                   "rules": [{"match": {"alertname": "Ckpt"},
                              "actions": [{"type": "checkpoint", "timeout_s": 30}]}]}
            with serve_app(create_app(Bridge(parse(raw, tmp_path)))) as client:
                row = checkpoint_until_settled(client, "r1")
            step = row["steps"][0]
            assert row["status"] == "done", step
            assert step["data"]["nodes"] == ["n1", "n2"]  # n3 serves another run
            assert sorted(step["data"]["acknowledged"]) == ["n1", "n2"]
            assert len(s1.checkpoint_requests) == len(s2.checkpoint_requests) == 1
            assert s3.checkpoint_requests == []


def test_checkpoint_by_signal_waits_for_every_rank_to_acknowledge_in_prometheus(
        tmp_path: Path) -> None:
    """No sidecar: SIGUSR1 through the `local` scheduler to a real hooked job (which serves its
    own /metrics), acknowledged once Prometheus shows a newer request id for the rank."""
    metrics_port, master_port = free_port(), free_port()
    raw = {"database": str(tmp_path / "b.db"), "auth": {"bearer_token": TOKEN},
           "schedulers": {"local": {
               "type": "local", "state_dir": str(tmp_path / "state"), "stop_timeout_s": 5,
               "command": [sys.executable, str(EXAMPLE), "--steps", "100000", "--step-sleep",
                           "0.05", "--checkpoint-dir", str(tmp_path / "ckpt")],
               "env": {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                       "ROBUST_METRICS_PORT": str(metrics_port)}}},
           "rules": [{"match": {"alertname": "Ckpt"},
                      "actions": [{"type": "checkpoint", "timeout_s": 30}]}]}
    with PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{metrics_port}"]) as prom:
        raw["prometheus"] = {"url": prom.url}
        bridge = Bridge(parse(raw, tmp_path))
        local = bridge.schedulers["local"]
        log = tmp_path / "state" / "r1.log"
        try:
            local.start("r1")
            wait_for_series(prom, 'robust_rank_info{run="r1"}', timeout=90)
            with serve_app(create_app(bridge)) as client:
                row = checkpoint_until_settled(client, "r1")
            step = row["steps"][0]
            assert row["status"] == "done", step
            assert step["data"]["before"] == {"0": 0.0}
            assert step["data"]["acknowledged"] == ["0"]
            assert "checkpoint acknowledged by ranks 0" in step["detail"]
            assert log.read_text().count("checkpoint at step") == 1, log.read_text()
        finally:
            local.cancel("r1", "test over")


def test_checkpoint_through_kubernetes_is_a_pod_annotation_acknowledged_in_prometheus(
        tmp_path: Path) -> None:
    """No sidecar, a `kubernetes` scheduler: the bridge's checkpoint annotates the run's pods in
    the fake API server, a kubelet stand-in projects each pod's annotations into its file, the
    real rank checkpoints once and Prometheus shows its acknowledgement."""
    pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")
    from tests.kube_fakes import FakeKubeAPI, kubeconfig, kubelet_write

    api = FakeKubeAPI()
    stop = threading.Event()
    podinfo = tmp_path / "podinfo"

    def kubelet() -> None:  # the kubelet's sync loop, for the one pod of this test
        last = None
        while not stop.wait(0.2):
            data = api.annotations_file("llama-worker-0")
            if data != last:
                kubelet_write(podinfo, "annotations", data)
                last = data

    kubelet_write(podinfo, "annotations", b"")
    sync = threading.Thread(target=kubelet, daemon=True)
    sync.start()
    metrics_port = free_port()
    try:
        api.add_job("PyTorchJob", "llama", pods=1)
        raw = {"database": str(tmp_path / "b.db"), "auth": {"bearer_token": TOKEN},
               "schedulers": {"k8s": {"type": "kubernetes", "auth": "kubeconfig", "timeout_s": 5,
                                      "kubeconfig": str(kubeconfig(tmp_path, api.url))}},
               "rules": [{"match": {"alertname": "Ckpt"},
                          "actions": [{"type": "checkpoint", "timeout_s": 30}]}]}
        env = {"ROBUST_METRICS_PORT": str(metrics_port),
               "ROBUST_METRICS_POD_ANNOTATIONS": str(podinfo / "annotations")}
        with PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{metrics_port}"]) as prom, \
                rank_job(1, ["--steps", "100000", "--step-sleep", "0.05"], env=env,
                         log_dir=tmp_path, run="llama") as job:
            raw["prometheus"] = {"url": prom.url}
            wait_for_series(prom, 'robust_rank_info{run="llama"}', timeout=90)
            with serve_app(create_app(Bridge(parse(raw, tmp_path)))) as client:
                row = checkpoint_until_settled(client, "llama")
            step = row["steps"][0]
            assert row["status"] == "done", step
            assert step["data"]["scheduler"] == "k8s" and step["data"]["pods"] == [
                "llama-worker-0"]
            assert step["data"]["acknowledged"] == ["0"]
            assert job.logs().count("checkpoint at step") == 1, job.logs()
        assert not api.violations
    finally:
        stop.set()
        sync.join(timeout=5)
        api.close()
