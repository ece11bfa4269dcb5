"""Checkpoint requests on Kubernetes end to end: the `kubernetes` adapter annotates the pods in
the fake API server, the test writes each pod's file as the kubelet does (a downward API volume),
and two real gloo ranks checkpoint exactly once per request. The parser and the hook in one
process: tests/test_pod_annotations.py.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from robust_metrics.rankfolder.control import CHECKPOINT_ANNOTATION
from tests.kube_fakes import kubelet_write
from tests.support import rank_job, wait_until


# ---------------------------------------------------------------------- end to end
def acknowledged(directory: Path) -> dict[str, float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {s.labels["rank"]: s.value for m in registry.collect() for s in m.samples
            if s.name == "robust_checkpoint_request_id"}


def checkpoints(job: object) -> dict[int, int]:
    text = job.logs()  # type: ignore[attr-defined]
    return {r: len(re.findall(rf"rank {r}: checkpoint at step", text)) for r in (0, 1)}


def test_the_adapter_annotation_reaches_two_gloo_ranks_exactly_once(tmp_path: Path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")
    from tests.kube_fakes import NS, FakeKubeAPI, adapter

    api = FakeKubeAPI()
    metrics, logs = tmp_path / "metrics", tmp_path / "logs"
    metrics.mkdir()
    logs.mkdir()
    try:
        api.add_job("PyTorchJob", "llama", pods=2)
        k = adapter(tmp_path, api)
        pods = {r: f"llama-worker-{r}" for r in (0, 1)}
        folders = {r: tmp_path / pods[r] for r in (0, 1)}

        def kubelet() -> None:  # what each pod's kubelet does after the API server changed
            for r in (0, 1):
                kubelet_write(folders[r], "annotations", api.annotations_file(pods[r]))

        kubelet()
        env = {"ROBUST_METRICS_DIR": str(metrics)}
        with rank_job(2, ["--steps", "100000", "--step-sleep", "0.02", "--clip", "0"],
                      env=env, log_dir=logs, rank_env=lambda r: {
                          "ROBUST_METRICS_POD_ANNOTATIONS": str(folders[r] / "annotations")},
                      ) as job:
            wait_until(lambda: len(acknowledged(metrics)) == 2, timeout=90)
            first = k.signal("llama", signal.SIGUSR1, key="incident-1#0")
            request_id = first.data["request_id"]
            assert first.data["pods"] == list(pods.values())
            kubelet()
            wait_until(lambda: acknowledged(metrics) == {"0": request_id, "1": request_id},
                       timeout=30)
            assert checkpoints(job) == {0: 1, 1: 1}
            # the bridge retries the step (same key): same id, the kubelet rewrites the files
            assert k.signal("llama", signal.SIGUSR1, key="incident-1#0").data[
                "request_id"] == request_id
            kubelet()
            time.sleep(2.0)  # four polls
            assert checkpoints(job) == {0: 1, 1: 1}, job.logs()
            second = k.signal("llama", signal.SIGUSR1, key="incident-2#0").data["request_id"]
            kubelet()
            wait_until(lambda: acknowledged(metrics) == {"0": second, "1": second}, timeout=30)
            assert checkpoints(job) == {0: 2, 1: 2}
        assert not api.violations and api.pod_annotations[(NS, pods[0])][
            CHECKPOINT_ANNOTATION] == str(second)
    finally:
        api.close()
