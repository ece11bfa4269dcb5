"""The sidecar as deployed: a real `robust-metrics sidecar` process and real rank processes.

Rank restarts use a torch-free writer (tests/fixtures/sidecar/rank_writer.py) that publishes through
the hook's real multiprocess sink, so 20 kill/restart cycles take seconds; stacks and checkpoints
use a real 2-rank gloo job with the hook (examples/train_ddp.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from robust_metrics.processes import spawn
from tests.support import ROOT, RankJob, SidecarProcess, require_binary, wait_until

WRITER = ROOT / "tests" / "fixtures" / "sidecar" / "rank_writer.py"
TOKEN = "integration-token"
QUIET = ["--no-collector.nvml", "--no-collector.nccl", "--no-collector.nic"]


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted labels: value}} of one scrape."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    response.raise_for_status()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def promtool_check(url: str) -> None:
    promtool = require_binary("promtool")
    text = httpx.get(f"{url}/metrics", timeout=10).content
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                            timeout=30)
    assert result.returncode == 0 and not result.stdout.strip(), (
        result.stdout.decode() + result.stderr.decode())


class Writer:
    """A torch-free rank process; `ready` once it has written its steps."""

    def __init__(self, directory: Path, *, rank: int = 0, steps: int = 5,
                 forever: bool = False) -> None:
        args = [sys.executable, str(WRITER), "--dir", str(directory), "--rank", str(rank),
                "--steps", str(steps)]
        if forever:
            args.append("--forever")
        self.proc = spawn(args, stdout=subprocess.PIPE, cwd=ROOT)
        line = self.proc.stdout.readline().decode()  # type: ignore[union-attr]
        if not line.startswith("ready"):
            self.kill()
            raise AssertionError(f"writer did not start: {line}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def metrics_dir(tmp_path: Path) -> Path:
    path = tmp_path / "metrics"
    path.mkdir()
    return path


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    started: list[Writer] = []
    try:
        yield started
    finally:
        for w in started:
            w.kill()


def test_rank_killed_and_restarted_20_times(metrics_dir: Path, tmp_path: Path,
                                            writers: list[Writer]) -> None:
    steps_per_life = 5
    with SidecarProcess(metrics_dir, [*QUIET, "--merge-after", "0"],
                        log_path=tmp_path / "sidecar.log") as sidecar:
        other = Writer(metrics_dir, rank=1, steps=3)  # a rank that never dies
        writers.append(other)
        previous_total = 0.0
        miscounts: list[tuple[int, float | None]] = []
        for cycle in range(20):
            writer = Writer(metrics_dir, rank=0, steps=steps_per_life)
            writers.append(writer)
            expected = steps_per_life * (cycle + 1)

            def settled(pid: int = writer.proc.pid, expected: int = expected) -> dict | None:
                m = scrape(sidecar.url)
                steps = m.get("robust_steps_total", {})
                total = steps.get((("rank", "0"), ("run", "writer-run")))
                info = [dict(k) for k in m.get("robust_rank_info", {}) if dict(k)["rank"] == "0"]
                if total == expected and [i["pid"] for i in info] == [str(pid)]:
                    return m
                return None

            m = wait_until(settled, timeout=20, message=f"cycle {cycle} to settle")
            total = m["robust_steps_total"][(("rank", "0"), ("run", "writer-run"))]
            assert total >= previous_total, "a counter went backwards"
            previous_total = total
            # exactly one live process per rank; the other rank is untouched
            alive = m["robust_rank_process_alive"]
            assert alive == {(("rank", "0"), ("run", "writer-run")): 1.0,
                             (("rank", "1"), ("run", "writer-run")): 1.0}
            assert m["robust_steps_total"][(("rank", "1"), ("run", "writer-run"))] == 3.0
            assert m["robust_step_duration_seconds_count"][
                (("rank", "0"), ("run", "writer-run"))] == expected
            writer.kill()
            writers.remove(writer)
            # after the kill: every scrape counts each step once, and the dead pid's gauges go
            # (within the sidecar's 0.25 s snapshot cache)

            def gone(expected: int = expected) -> bool:
                after = scrape(sidecar.url)
                key = (("rank", "0"), ("run", "writer-run"))
                if after["robust_steps_total"].get(key) != expected:
                    miscounts.append((expected, after["robust_steps_total"].get(key)))
                return not [k for k in after.get("robust_rank_info", {}) if dict(k)["rank"] == "0"]

            wait_until(gone, timeout=10, interval=0.05, message="dead rank's gauges to vanish")
            assert not miscounts, f"double or lost counts after a kill: {miscounts}"
        dbs = [p for p in os.listdir(metrics_dir) if p.endswith(".db")]
        assert len(dbs) <= 4, f"dead files were not merged: {dbs}"
        assert scrape(sidecar.url)["robust_sidecar_corrupt_files_total"][()] == 0
        promtool_check(sidecar.url)


def test_50_concurrent_scrapes_while_ranks_write(metrics_dir: Path, tmp_path: Path,
                                                  writers: list[Writer]) -> None:
    for rank in range(4):
        writers.append(Writer(metrics_dir, rank=rank, steps=20, forever=True))
    with SidecarProcess(metrics_dir, QUIET, log_path=tmp_path / "sidecar.log") as sidecar:
        def one(_: int) -> tuple[int, float]:
            r = httpx.get(f"{sidecar.url}/metrics", timeout=30)
            steps = sum(s.value for f in text_string_to_metric_families(r.text)
                        for s in f.samples if s.name == "robust_steps_total")
            return r.status_code, steps

        with ThreadPoolExecutor(max_workers=50) as pool:
            results = list(pool.map(one, range(50)))
        assert [code for code, _ in results] == [200] * 50
        assert all(steps >= 80 for _, steps in results), results
        promtool_check(sidecar.url)


@pytest.fixture
def gloo_job(tmp_path: Path, metrics_dir: Path) -> Iterator[RankJob]:
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {"ROBUST_METRICS_DIR": str(metrics_dir)}
    with RankJob(2, ["--steps", "100000", "--step-sleep", "0.05"], env=env, log_dir=logs,
                 run="gloo-job") as job:
        yield job


def test_stacks_and_checkpoint_of_a_real_gloo_job(gloo_job: RankJob, metrics_dir: Path,
                                                   tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    args = [*QUIET, "--token-file", str(token)]
    with SidecarProcess(metrics_dir, args, log_path=tmp_path / "sidecar.log") as sidecar:
        key0, key1 = (("rank", "0"), ("run", "gloo-job")), (("rank", "1"), ("run", "gloo-job"))

        def stepping() -> bool:
            steps = scrape(sidecar.url).get("robust_steps_total", {})
            return steps.get(key0, 0) >= 3 and steps.get(key1, 0) >= 3

        wait_until(stepping, timeout=120, message=lambda: f"ranks stepping\n{gloo_job.logs()}")
        m = scrape(sidecar.url)
        assert m["robust_rank_process_alive"] == {key0: 1.0, key1: 1.0}
        assert 0 <= m["robust_rank_step_age_seconds"][key0] < 30
        assert m["robust_rank_process_resident_memory_bytes"][key0] > 10e6
        pids = {dict(k)["pid"] for k in m["robust_rank_info"]}
        assert pids == {str(p) for p in gloo_job.pids}
        promtool_check(sidecar.url)

        # stacks: 401 without the token, real frames with it
        assert httpx.get(f"{sidecar.url}/debug/stacks", timeout=30).status_code == 401
        response = httpx.get(f"{sidecar.url}/debug/stacks",
                             headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert response.status_code == 200, response.text
        body = response.json()
        assert [(r["rank"], r["pid"]) for r in body["ranks"]] == [
            ("0", gloo_job.pids[0]), ("1", gloo_job.pids[1])]
        for rank in body["ranks"]:
            assert rank["error"] is None, rank["error"]
            files = {f["file"] for t in rank["threads"] for f in t["frames"]}
            functions = {f["function"] for t in rank["threads"] for f in t["frames"]}
            assert any(f.endswith("train_ddp.py") for f in files), files
            assert "main" in functions

        # checkpoint: the callback runs once per rank, acknowledged through the metrics
        response = httpx.post(f"{sidecar.url}/control/checkpoint",
                              headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert response.status_code == 202, response.text
        request_id = response.json()["request_id"]

        def acknowledged() -> bool:
            ids = scrape(sidecar.url).get("robust_checkpoint_request_id", {})
            return ids.get(key0) == request_id and ids.get(key1) == request_id

        wait_until(acknowledged, timeout=60, message=lambda: f"checkpoint ack\n{gloo_job.logs()}")
        m = scrape(sidecar.url)
        assert m["robust_last_checkpoint_timestamp_seconds"][key0] > time.time() - 120
        time.sleep(1.5)  # a second poll must not run it again
        logs = gloo_job.logs()
        for rank in (0, 1):
            assert logs.count(f"rank {rank}: checkpoint at step") == 1, logs


def test_hung_rank_age_grows_and_stacks_show_where(metrics_dir: Path, tmp_path: Path) -> None:
    """Rank 1 stops at step 5; rank 0 then waits in all_reduce. Neither can report it; the
    sidecar's step age grows for both, and the stacks say where each one is."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    logs = tmp_path / "logs"
    logs.mkdir()
    with RankJob(2, ["--steps", "1000", "--hang-rank", "1", "--hang-step", "5"],
                 env={"ROBUST_METRICS_DIR": str(metrics_dir)}, log_dir=logs, run="hang") as job, \
            SidecarProcess(metrics_dir, [*QUIET, "--token-file", str(token)],
                           log_path=tmp_path / "sidecar.log") as sidecar:
        key0, key1 = (("rank", "0"), ("run", "hang")), (("rank", "1"), ("run", "hang"))
        wait_until(lambda: "hanging at step 5" in job.logs(), timeout=120,
                   message=lambda: f"rank 1 to hang\n{job.logs()}")
        first = scrape(sidecar.url)
        time.sleep(2.0)
        second = scrape(sidecar.url)
        for key in (key0, key1):
            assert second["robust_rank_process_alive"][key] == 1.0
            grown = (second["robust_rank_step_age_seconds"][key]
                     - first["robust_rank_step_age_seconds"][key])
            assert grown >= 1.5, (key, first["robust_rank_step_age_seconds"],
                                  second["robust_rank_step_age_seconds"])
        assert second["robust_steps_total"][key1] == 5.0
        response = httpx.get(f"{sidecar.url}/debug/stacks?rank=1",
                             headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert response.status_code == 200, response.text
        (hung,) = response.json()["ranks"]
        assert hung["rank"] == "1" and hung["pid"] == job.pids[1]
        main_frames = [f for t in hung["threads"] for f in t["frames"]
                       if f["file"].endswith("train_ddp.py")]
        assert any(f["function"] == "main" for f in main_frames), hung


@pytest.mark.gpu
def test_real_nvml_where_a_gpu_exists() -> None:
    from prometheus_client import CollectorRegistry

    from robust_metrics.sidecar.collectors.nvml import NvmlCollector
    from robust_metrics.sidecar.collectors.registry import ScrapeRegistry

    collector = NvmlCollector("gpu-node", xid_events=True)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeRegistry({"nvml": collector}))  # type: ignore[arg-type]
    try:
        assert registry.get_sample_value("robust_nvml_up", {"node": "gpu-node"}) == 1.0
        total = registry.get_sample_value("robust_gpu_memory_total_bytes",
                                          {"node": "gpu-node", "gpu": "0"})
        assert total is not None and total > 1 << 30
        assert registry.get_sample_value("robust_gpu_lost", {"node": "gpu-node", "gpu": "0"}) == 0
        temp = registry.get_sample_value("robust_gpu_temperature_celsius",
                                         {"node": "gpu-node", "gpu": "0"})
        assert temp is None or 0 < temp < 120
    finally:
        collector.close()


@pytest.mark.gpu
def test_a_rank_on_a_real_gpu_gets_that_gpus_peak(tmp_path: Path) -> None:
    """This process plays a rank that counts FLOPs and holds a CUDA context on GPU 0: the
    sidecar publishes the peak of the GPU NVML sees it on (GPU 0 by its local rank where the
    container hides its pid)."""
    import json

    from prometheus_client import CollectorRegistry

    from robust_metrics import schema
    from robust_metrics.hooks.metric_store import MetricStore
    from robust_metrics.hooks.sinks import MultiprocessSink
    from robust_metrics.sidecar.collectors.nvml import NvmlCollector
    from robust_metrics.sidecar.collectors.registry import ScrapeRegistry
    from robust_metrics.sidecar.gpu_peaks import peak_flops
    from robust_metrics.sidecar.rank_files import RankFiles

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    held = torch.ones(1, device="cuda:0")  # a CUDA context: NVML lists this process on GPU 0
    store = MetricStore({"run": "gpu", "rank": "0"})
    store.series(schema.MODEL_FLOPS).inc(1e12)
    MultiprocessSink(str(tmp_path)).flush(store)
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / f"{os.getpid()}.json").write_text(json.dumps(
        {"run": "gpu", "rank": 0, "local_rank": 0, "pid": os.getpid(), "started": time.time() - 1}))
    folder = RankFiles(str(tmp_path), cache_seconds=0)
    collector = NvmlCollector("gpu-node", folder, xid_events=False)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeRegistry({"nvml": collector}))  # type: ignore[arg-type]
    try:
        expected = peak_flops(torch.cuda.get_device_name(0), "bf16")
        if expected is None:
            pytest.skip(f"{torch.cuda.get_device_name(0)} has no bf16 peak in the table")
        peak = registry.get_sample_value("robust_rank_gpu_peak_flops", {"run": "gpu", "rank": "0"})
        assert peak == expected, (peak, torch.cuda.get_device_name(0))
    finally:
        collector.close()
        folder.close()
        del held
