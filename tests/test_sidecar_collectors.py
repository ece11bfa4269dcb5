"""Collectors against fixtures: a sysfs tree, a fake pynvml, a fake NCCL RAS port; the registry."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily

from robust_metrics import schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink
from robust_metrics.rankfolder.identity import RankIdentity
from robust_metrics.sidecar import proc_connector
from robust_metrics.sidecar.collectors import process as process_collector
from robust_metrics.sidecar.collectors.nccl_ras import (
    NcclRasCollector,
    parse_json_report,
    parse_text_report,
)
from robust_metrics.sidecar.collectors.nic import NicCollector, parse_rate
from robust_metrics.sidecar.collectors.node_summaries import NodeSummariesCollector
from robust_metrics.sidecar.collectors.nvml import NvmlCollector
from robust_metrics.sidecar.collectors.process import (
    WRITES_STALE_AFTER,
    ProcessCollector,
    exit_time,
    step_age,
)
from robust_metrics.sidecar.collectors.ranks import RanksCollector
from robust_metrics.sidecar.collectors.registry import ScrapeRegistry, available
from robust_metrics.sidecar.proc_connector import ProcExits
from robust_metrics.sidecar.rank_files import RankFiles
from tests.sidecar_fakes import FakeGpu, FakeNvml, FakeRasServer
from tests.support import ROOT, free_port, require_binary, wait_until

SYSFS = ROOT / "tests" / "fixtures" / "sysfs"
FIXTURES = ROOT / "tests" / "fixtures" / "sidecar"
GOLDEN = FIXTURES / "golden_scrape.prom"


def registry_of(**collectors: object) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeRegistry(collectors, node="n1"))  # type: ignore[arg-type]
    return registry


def sample(registry: CollectorRegistry, name: str, /, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def two_gpus() -> FakeNvml:
    return FakeNvml([FakeGpu("GPU-aaaa"), FakeGpu("GPU-bbbb", util=3, throttle=0)])


def scrape_text(registry: CollectorRegistry) -> str:
    """The exposition with collector durations masked (they differ every run)."""
    text = generate_latest(registry).decode()
    return re.sub(r"(robust_sidecar_collector_duration_seconds\{[^}]*\}) \S+", r"\1 <duration>",
                  text)


def test_every_name_a_collector_exports_is_declared_in_the_schema(tmp_path: Path) -> None:
    # this process plays a rank: identity plus files written by the hook's sink
    store = MetricStore({"run": "r", "rank": "0"})
    store.series(schema.STEPS_TOTAL).inc()
    store.series(schema.LAST_STEP_TIMESTAMP).set(time.time())
    store.series(schema.STEP_DURATION).observe(0.1)
    store.series(schema.STEP_COMPUTE_MEAN, window="1m").set(0.1)
    sink = MultiprocessSink(str(tmp_path))
    sink.flush(store)
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / f"{os.getpid()}.json").write_text(json.dumps(
        {"run": "r", "rank": 0, "pid": os.getpid(), "started": time.time() - 1}))
    folder = RankFiles(str(tmp_path), cache_seconds=0)
    nvml = two_gpus()
    nvml.gpus[0].pids = [os.getpid()]
    registry = registry_of(ranks=RanksCollector(folder), process=ProcessCollector(folder),
                           node_summaries=NodeSummariesCollector(folder, "n1"),
                           nic=NicCollector(str(SYSFS), "n1"),
                           nvml=NvmlCollector("n1", folder, nvml=nvml, xid_events=False))
    declared = schema.sample_names()
    seen = set()
    for metric in registry.collect():
        for s in metric.samples:
            assert s.name in declared, f"{s.name} is not declared in robust_metrics.schema"
            if declared[s.name].source is schema.Source.SIDECAR and "quantile" in \
                    declared[s.name].labels:
                # a summary's _sum and _count have no quantile; a node without a pipeline no stage
                assert set(declared[s.name].labels) - {"quantile", "pp_rank"} <= set(s.labels)
                assert set(s.labels) <= set(declared[s.name].labels), s.name
            else:
                assert set(s.labels) == set(declared[s.name].labels), s.name
            seen.add(s.name)
    assert {"robust_rank_process_alive", "robust_rank_step_age_seconds", "robust_steps_total",
            "robust_rank_gpu_info", "robust_sidecar_corrupt_files_total",
            "robust_node_step_compute_mean_seconds_count"} <= seen
    sink.close(store)
    folder.close()


def test_full_scrape_matches_golden_file() -> None:
    registry = registry_of(nic=NicCollector(str(SYSFS), "n1"),
                           nvml=NvmlCollector("n1", nvml=two_gpus(), xid_events=False))
    text = scrape_text(registry)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "scrape differs from golden (UPDATE_GOLDEN=1 rewrites it)"


def test_golden_scrape_passes_promtool() -> None:
    promtool = require_binary("promtool")
    text = GOLDEN.read_text().replace("<duration>", "0.001")
    result = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert not result.stdout.strip(), result.stdout.decode()  # lint findings print here


# -- nic ---------------------------------------------------------------------------------------
def test_nic_reads_ports_counters_and_physical_netdevs() -> None:
    registry = registry_of(nic=NicCollector(str(SYSFS), "n1"))
    port = {"node": "n1", "device": "mlx5_0", "port": "1"}
    assert sample(registry, "robust_nic_port_up", **port) == 1.0
    assert sample(registry, "robust_nic_port_up", **{**port, "device": "mlx5_1"}) == 0.0
    assert sample(registry, "robust_nic_port_rate_bytes", **port) == 200e9 / 8
    assert sample(registry, "robust_nic_transmit_bytes_total", **port) == 1234567 * 4
    assert sample(registry, "robust_nic_receive_bytes_total", **port) == 7654321 * 4
    assert sample(registry, "robust_nic_port_errors_total", **port, counter="symbol_error") == 3
    assert sample(registry, "robust_nic_port_errors_total", **port,
                  counter="port_xmit_discards") == 17
    # "N/A (no PMA)" is skipped, not exported as 0
    assert sample(registry, "robust_nic_port_errors_total", **{**port, "device": "mlx5_1"},
                  counter="symbol_error") is None
    assert sample(registry, "robust_netdev_carrier_changes_total", node="n1",
                  interface="eth1") == 9
    assert sample(registry, "robust_netdev_up", node="n1", interface="eth1") == 0
    assert sample(registry, "robust_netdev_up", node="n1", interface="veth12") is None
    assert sample(registry, "robust_netdev_up", node="n1", interface="lo") is None


def test_nic_without_infiniband_exports_nothing_and_succeeds(tmp_path: Path) -> None:
    registry = registry_of(nic=NicCollector(str(tmp_path), "n1"))
    assert sample(registry, "robust_sidecar_collector_success", node="n1", collector="nic") == 1.0
    assert sample(registry, "robust_nic_port_up", node="n1", device="x", port="1") is None


def test_parse_rate() -> None:
    assert parse_rate("400 Gb/sec (4X NDR)") == 50e9
    assert parse_rate("2.5 Gb/sec (1X SDR)") == 2.5e9 / 8
    assert parse_rate("garbage") is None


# -- nvml --------------------------------------------------------------------------------------
def test_nvml_values_and_flags() -> None:
    registry = registry_of(nvml=NvmlCollector("n1", nvml=two_gpus(), xid_events=False))
    g0 = {"node": "n1", "gpu": "0"}
    assert sample(registry, "robust_nvml_up", node="n1") == 1.0
    assert sample(registry, "robust_gpu_info", **g0, uuid="GPU-aaaa",
                  name="NVIDIA H100 80GB HBM3") == 1.0
    assert sample(registry, "robust_gpu_utilization_ratio", **g0) == 0.87
    assert sample(registry, "robust_gpu_memory_used_bytes", **g0) == 40 << 30
    assert sample(registry, "robust_gpu_memory_total_bytes", **g0) == 80 << 30
    assert sample(registry, "robust_gpu_temperature_celsius", **g0) == 61
    assert sample(registry, "robust_gpu_power_watts", **g0) == 350.0
    assert sample(registry, "robust_gpu_energy_joules_total", **g0) == 9000.0
    assert sample(registry, "robust_gpu_sm_clock_hertz", **g0) == 1980e6
    assert sample(registry, "robust_gpu_memory_clock_hertz", **g0) == 2619e6
    assert sample(registry, "robust_gpu_clock_throttle", **g0, reason="hw_thermal_slowdown") == 1
    assert sample(registry, "robust_gpu_clock_throttle", **g0, reason="sw_power_cap") == 1
    assert sample(registry, "robust_gpu_clock_throttle", **g0, reason="hw_slowdown") == 0
    assert sample(registry, "robust_gpu_clock_throttle", node="n1", gpu="1",
                  reason="hw_thermal_slowdown") == 0
    assert sample(registry, "robust_gpu_ecc_errors_total", **g0, type="corrected") == 12
    assert sample(registry, "robust_gpu_ecc_errors_total", **g0, type="uncorrected") == 0
    assert sample(registry, "robust_gpu_row_remap_pending", **g0) == 1
    assert sample(registry, "robust_gpu_row_remap_failure", **g0) == 0
    assert sample(registry, "robust_gpu_pcie_replays_total", **g0) == 5
    assert sample(registry, "robust_gpu_nvlink_errors_total", **g0, link="0", type="crc_flit") == 3
    assert sample(registry, "robust_gpu_nvlink_errors_total", **g0, link="0", type="replay") == 1
    assert sample(registry, "robust_gpu_nvlink_errors_total", **g0, link="2",
                  type="replay") is None  # link 2 is down
    assert sample(registry, "robust_gpu_lost", **g0) == 0


def test_nvml_publishes_each_gpus_peak_flops_from_its_name() -> None:
    nvml = FakeNvml([FakeGpu("GPU-aaaa"), FakeGpu("GPU-bbbb", name="NVIDIA A10G"),
                     FakeGpu("GPU-cccc", name="Tesla V100-SXM2-32GB")])
    registry = registry_of(nvml=NvmlCollector("n1", nvml=nvml, xid_events=False))
    assert sample(registry, "robust_gpu_peak_flops", node="n1", gpu="0") == 989e12
    assert sample(registry, "robust_gpu_peak_flops", node="n1", gpu="1") is None  # not in table
    assert sample(registry, "robust_gpu_peak_flops", node="n1", gpu="2") is None  # no bf16
    fp16 = registry_of(nvml=NvmlCollector("n1", nvml=nvml, xid_events=False, peak_dtype="fp16",
                                          peak_overrides=[("A10G", 70e12)]))
    assert sample(fp16, "robust_gpu_peak_flops", node="n1", gpu="0") == 989e12
    assert sample(fp16, "robust_gpu_peak_flops", node="n1", gpu="1") == 70e12
    assert sample(fp16, "robust_gpu_peak_flops", node="n1", gpu="2") == 125e12


def test_unsupported_field_costs_only_its_series() -> None:
    nvml = two_gpus()
    nvml.gpus[0].unsupported = {"energy", "remap"}
    registry = registry_of(nvml=NvmlCollector("n1", nvml=nvml, xid_events=False))
    assert sample(registry, "robust_gpu_energy_joules_total", node="n1", gpu="0") is None
    assert sample(registry, "robust_gpu_row_remap_pending", node="n1", gpu="0") is None
    assert sample(registry, "robust_gpu_energy_joules_total", node="n1", gpu="1") == 9000.0
    assert sample(registry, "robust_gpu_temperature_celsius", node="n1", gpu="0") == 61
    assert sample(registry, "robust_sidecar_collector_success", node="n1", collector="nvml") == 1.0


def test_gpu_falling_off_the_bus_is_reported_and_others_keep_serving() -> None:
    nvml = two_gpus()
    collector = NvmlCollector("n1", nvml=nvml, xid_events=False)
    registry = registry_of(nvml=collector)
    assert sample(registry, "robust_gpu_lost", node="n1", gpu="1") == 0
    nvml.gpus[1].lost = True
    assert sample(registry, "robust_gpu_lost", node="n1", gpu="1") == 1
    assert sample(registry, "robust_gpu_temperature_celsius", node="n1", gpu="1") is None
    assert sample(registry, "robust_gpu_info", node="n1", gpu="1", uuid="GPU-bbbb",
                  name="NVIDIA H100 80GB HBM3") is None
    assert sample(registry, "robust_gpu_temperature_celsius", node="n1", gpu="0") == 61
    assert sample(registry, "robust_nvml_up", node="n1") == 1.0


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
                                  pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_missing_driver_reads_as_nvml_down_and_is_retried(code: int) -> None:
    nvml = FakeNvml([FakeGpu("GPU-aaaa")], init_error=code)
    now = [1000.0]
    collector = NvmlCollector("n1", nvml=nvml, retry_seconds=60, xid_events=False,
                              clock=lambda: now[0])
    registry = registry_of(nvml=collector)
    assert sample(registry, "robust_nvml_up", node="n1") == 0.0
    assert sample(registry, "robust_sidecar_collector_success", node="n1", collector="nvml") == 1.0
    nvml.init_error = None  # driver loaded, but no retry before 60 s
    assert sample(registry, "robust_nvml_up", node="n1") == 0.0
    now[0] += 61
    assert sample(registry, "robust_nvml_up", node="n1") == 1.0
    assert sample(registry, "robust_gpu_temperature_celsius", node="n1", gpu="0") == 61


def test_xid_events_are_counted_by_code() -> None:
    nvml = two_gpus()
    collector = NvmlCollector("n1", nvml=nvml, xid_events=True)
    registry = registry_of(nvml=collector)
    try:
        assert sample(registry, "robust_nvml_up", node="n1") == 1.0
        for gpu, xid in ((1, 79), (1, 79), (0, 48)):
            nvml.events.put((gpu, xid))
        wait_until(lambda: sample(registry, "robust_gpu_xid_errors_total", node="n1", gpu="1",
                                  xid="79") == 2, timeout=10, message="XID 79 counted twice")
        assert sample(registry, "robust_gpu_xid_errors_total", node="n1", gpu="0", xid="48") == 1
    finally:
        collector.close()
    assert not nvml.initialised


def test_rank_gpu_mapping_from_running_processes(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "4242.json").write_text(json.dumps(
        {"run": "job7", "rank": 3, "pid": 4242, "started": time.time()}))
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: pid == 4242, cache_seconds=0)
    nvml = two_gpus()
    nvml.gpus[1].pids = [4242, 999]
    registry = registry_of(nvml=NvmlCollector("n1", folder, nvml=nvml, xid_events=False))
    assert sample(registry, "robust_rank_gpu_info", run="job7", rank="3", node="n1", gpu="1",
                  uuid="GPU-bbbb") == 1.0
    folder.close()


def test_each_rank_counting_flops_gets_the_peak_of_its_own_gpu(tmp_path: Path) -> None:
    """The MFU denominator per rank: the GPU NVML sees the rank on, else its local rank's GPU;
    no series for a rank that counts no FLOPs or runs on a GPU with no known peak."""
    (tmp_path / "ranks").mkdir()
    ranks = {  # pid: (rank, local rank, counts FLOPs)
        101: ("0", "0", True),  # NVML sees it on GPU 1, not GPU 0 of its local rank
        102: ("1", "0", True),  # NVML does not see it (a hidden pid): GPU 0 by its local rank
        103: ("2", "2", True),  # GPU 2, an A10G, has no bf16 peak in the table
        104: ("3", "0", False),  # counts no FLOPs (no flops_per_step)
    }
    for pid, (rank, local_rank, counts) in ranks.items():
        store = MetricStore({"run": "j", "rank": rank})
        store.series(schema.STEPS_TOTAL).inc()
        if counts:
            store.series(schema.MODEL_FLOPS).inc(1e15)
        MultiprocessSink(str(tmp_path), pid=pid).flush(store)
        (tmp_path / "ranks" / f"{pid}.json").write_text(json.dumps(
            {"run": "j", "rank": rank, "local_rank": local_rank, "pid": pid,
             "started": time.time()}))
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: pid in ranks, cache_seconds=0)
    nvml = FakeNvml([FakeGpu("GPU-aaaa", name="NVIDIA A100-SXM4-80GB"),
                     FakeGpu("GPU-bbbb"), FakeGpu("GPU-cccc", name="NVIDIA A10G")])
    nvml.gpus[0].pids = [104]
    nvml.gpus[1].pids = [101]
    registry = registry_of(nvml=NvmlCollector("n1", folder, nvml=nvml, xid_events=False))
    peaks = {s.labels["rank"]: s.value for m in registry.collect() for s in m.samples
             if s.name == "robust_rank_gpu_peak_flops"}
    assert peaks == {"0": 989e12, "1": 312e12}
    folder.close()


# -- nccl RAS ----------------------------------------------------------------------------------
def test_parse_text_report_of_nccl_2_24() -> None:
    report = parse_text_report((FIXTURES / "ras_status_2.24.txt").read_text())
    assert (report.communicators, report.missing_ranks, report.errors) == (9, 2, 1)


def test_parse_json_report() -> None:
    report = parse_json_report((FIXTURES / "ras_status.json").read_text())
    assert (report.communicators, report.missing_ranks, report.errors) == (2, 1, 1)


@pytest.mark.parametrize("with_json", [False, True])
def test_nccl_collector_queries_the_ras_port(with_json: bool) -> None:
    text = (FIXTURES / "ras_status_2.24.txt").read_text()
    json_report = (FIXTURES / "ras_status.json").read_text() if with_json else None
    server = FakeRasServer(text, json_report)
    collector = NcclRasCollector("n1", f"127.0.0.1:{server.port}", interval=3600, background=False)
    try:
        collector.refresh()
        registry = registry_of(nccl=collector)
        assert sample(registry, "robust_nccl_ras_up", node="n1") == 1.0
        expected = (2, 1, 1) if with_json else (9, 2, 1)
        got = tuple(sample(registry, name, node="n1") for name in (
            "robust_nccl_communicators", "robust_nccl_missing_ranks", "robust_nccl_errors"))
        assert got == expected
        assert server.commands[0] == "CLIENT PROTOCOL 2" and "STATUS" in server.commands
        server.close()  # the job ended: RAS gone, so up turns 0 and the values go
        collector.refresh()
        assert sample(registry, "robust_nccl_ras_up", node="n1") == 0.0
        assert sample(registry, "robust_nccl_communicators", node="n1") is None
    finally:
        collector.close()
        server.close()


def test_nccl_collector_exports_nothing_when_nothing_listens() -> None:
    collector = NcclRasCollector("n1", f"127.0.0.1:{free_port()}", interval=3600, background=False)
    collector.refresh()
    registry = registry_of(nccl=collector)
    names = {s.name for m in registry.collect() for s in m.samples}
    assert not any(n.startswith("robust_nccl") for n in names)
    assert sample(registry, "robust_sidecar_collector_success", node="n1", collector="nccl") == 1.0
    collector.close()


# -- registry ----------------------------------------------------------------------------------
class Broken:
    def collect(self) -> list:
        raise RuntimeError("boom")


def test_failing_collector_costs_its_series_not_the_scrape() -> None:
    registry = registry_of(broken=Broken(), nic=NicCollector(str(SYSFS), "n1"))
    assert sample(registry, "robust_sidecar_collector_success", node="n1",
                  collector="broken") == 0.0
    assert sample(registry, "robust_sidecar_collector_success", node="n1", collector="nic") == 1.0
    assert sample(registry, "robust_sidecar_collector_duration_seconds", node="n1",
                  collector="nic") >= 0
    assert sample(registry, "robust_nic_port_up", node="n1", device="mlx5_0", port="1") == 1.0


def test_every_collector_is_registered_with_a_flag() -> None:
    assert set(available()) == {"ranks", "node_summaries", "process", "nvml", "nic", "nccl",
                                "selftest"}


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value
        self.family = GaugeMetricFamily("robust_rank_gpu_info", "h",
                                        labels=["run", "rank", "node", "gpu", "uuid"])
        self.family.add_metric(["r", str(int(value)), "n", "0", "u"], 1.0)

    def collect(self) -> list:
        return [self.family]  # the same object every scrape, like a cached snapshot


def test_families_from_two_collectors_merge_without_growing_across_scrapes() -> None:
    a, b = Constant(1), Constant(2)
    registry = registry_of(a=a, b=b)
    for _ in range(3):
        samples = [s for m in registry.collect() for s in m.samples
                   if s.name == "robust_rank_gpu_info"]
        assert len(samples) == 2
    assert len(a.family.samples) == 1 and len(b.family.samples) == 1


class Hanging:
    """A collector stuck in a call (as NVML can be on a GPU in a bad state) until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def collect(self) -> list:
        self.calls += 1
        self.release.wait(30)
        return []


def test_hung_collector_is_reported_failed_and_never_piles_up() -> None:
    hanging = Hanging()
    scrape = ScrapeRegistry({"stuck": hanging, "nic": NicCollector(str(SYSFS), "n1")},
                            timeout=0.3, node="n1")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(scrape)  # type: ignore[arg-type]
    try:
        for _ in range(3):
            started = time.monotonic()
            assert sample(registry, "robust_sidecar_collector_success", node="n1",
                          collector="stuck") == 0.0
            assert time.monotonic() - started < 3
            assert sample(registry, "robust_nic_port_up", node="n1", device="mlx5_0",
                          port="1") == 1.0
        assert hanging.calls == 1, "a hung collector must not be started again"
        hanging.release.set()
        wait_until(lambda: sample(registry, "robust_sidecar_collector_success", node="n1",
                                  collector="stuck") == 1.0, timeout=10, message="recovery")
    finally:
        hanging.release.set()
        scrape.close()


class Slow:
    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> list:
        self.calls += 1
        time.sleep(0.5)
        return [GaugeMetricFamily("robust_nvml_up", "h", labels=["node"])]


def test_concurrent_scrapes_share_one_run_of_a_collector() -> None:
    slow = Slow()
    scrape = ScrapeRegistry({"slow": slow}, timeout=5)
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda _: list(scrape.collect()), range(4)))
        assert all(any(m.name == "robust_nvml_up" for m in r) for r in results)
        assert slow.calls == 1
    finally:
        scrape.close()


def test_process_collector_sees_stop_normal_end_and_exit_time(tmp_path: Path) -> None:
    """Three real processes play ranks: one stopped with SIGSTOP, one that finished normally and
    exited, one killed with SIGKILL. The exit time comes from the kernel's pidfd report, not the
    scrape that notices it."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(4)]
    try:
        (tmp_path / "ranks").mkdir()
        for rank, proc in enumerate(procs):
            identity = {"run": "r", "rank": rank, "pid": proc.pid, "started": time.time()}
            if rank == 1:
                identity["finished"] = time.time()  # what close() writes
            (tmp_path / "ranks" / f"{proc.pid}.json").write_text(json.dumps(identity))
        folder = RankFiles(str(tmp_path), cache_seconds=0)
        collector = ProcessCollector(folder)
        registry = registry_of(process=collector)
        assert sample(registry, "robust_rank_process_stopped", run="r", rank="0") is None
        os.kill(procs[0].pid, signal.SIGSTOP)
        wait_until(lambda: sample(registry, "robust_rank_process_stopped", run="r", rank="0") == 1,
                   timeout=5, message="stopped rank seen in state T")
        assert sample(registry, "robust_rank_finished", run="r", rank="0") is None
        assert sample(registry, "robust_rank_finished", run="r", rank="1") == 1
        assert sample(registry, "robust_rank_step_age_seconds", run="r", rank="1") is None

        procs[2].kill()
        killed_at = time.time()
        procs[2].wait()
        time.sleep(1.0)  # the next scrape comes a second later
        exited = sample(registry, "robust_rank_exit_timestamp_seconds", run="r", rank="2",
                        pid=str(procs[2].pid))
        assert exited is not None and abs(exited - killed_at) < 0.5, (exited, killed_at)
        assert sample(registry, "robust_rank_process_alive", run="r", rank="2") == 0
        assert sample(registry, "robust_rank_exit_timestamp_seconds", run="r", rank="0",
                      pid=str(procs[0].pid)) is None
        assert sample(registry, "robust_rank_finished", run="r", rank="2") is None  # a crash

        # SIGTERM (a launcher stopping survivors, a cancelled job) is a stop on request
        procs[3].terminate()
        time.sleep(1.0)  # unreaped for a moment, as a launcher polls its children
        procs[3].wait()
        assert sample(registry, "robust_rank_finished", run="r", rank="3") == 1
        collector.exits.close()
        folder.close()
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_a_rank_that_says_when_an_exception_ended_it_is_ordered_by_that_time(
        tmp_path: Path) -> None:
    """Two ranks die before any scrape saw them alive (a crash at start-up): the sidecar notices
    both in one scrape, so only the time the crashed rank wrote orders it before the peer that
    died of it. A written time before the rank's start or after the exit the sidecar saw is the
    job's claim, not a time: ignored. The pid label tells the exit of one process of a rank
    from the next one's."""
    started = time.time() - 30
    (tmp_path / "ranks").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(4)]
    for proc in procs:
        proc.wait()
    claims = {0: None, 1: started + 10, 2: started - 5, 3: time.time() + 3600}
    for rank, (proc, crashed) in enumerate(zip(procs, claims.values(), strict=True)):
        identity: dict[str, object] = {"run": "r", "rank": rank, "started": started}
        if crashed is not None:
            identity["crashed"] = crashed
        (tmp_path / "ranks" / f"{proc.pid}.json").write_text(json.dumps(identity))
    folder = RankFiles(str(tmp_path), cache_seconds=0)
    collector = ProcessCollector(folder)
    try:
        seen = time.time()
        registry = registry_of(process=collector)
        exits = {rank: sample(registry, "robust_rank_exit_timestamp_seconds", run="r",
                              rank=str(rank), pid=str(proc.pid))
                 for rank, proc in enumerate(procs)}
        assert exits[1] == started + 10
        for rank in (0, 2, 3):  # no claim, a claim before the start, a claim in the future
            assert exits[rank] is not None and abs(exits[rank] - seen) < 2, (rank, exits)
        assert sample(registry, "robust_rank_finished", run="r", rank="1") is None
    finally:
        collector.exits.close()
        folder.close()


def _connector_or_skip() -> None:
    events = ProcExits.open()
    if events is None:
        pytest.skip("the process events connector needs CAP_NET_ADMIN in the host's network "
                    "namespace; this machine refuses it")
    events.close()


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_exit_signal_survives_a_parent_that_reaps_at_once(tmp_path: Path, how: str) -> None:
    """A launcher reaps its workers within a millisecond of their exit, before the zombie can be
    read: SIGTERM (a restart, a cancel) must still read as a stop on request and SIGKILL as a
    crash, in every one of several tries."""
    _connector_or_skip()
    (tmp_path / "ranks").mkdir()
    folder = RankFiles(str(tmp_path), cache_seconds=0)
    collector = ProcessCollector(folder)
    registry = registry_of(process=collector)
    try:
        for rank in range(5):
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            identity = {"run": "r", "rank": rank, "pid": proc.pid, "started": time.time()}
            (tmp_path / "ranks" / f"{proc.pid}.json").write_text(json.dumps(identity))
            wait_until(lambda r=rank: sample(registry, "robust_rank_process_alive", run="r",
                                             rank=str(r)) == 1, timeout=5, message="alive")
            getattr(proc, how)()
            proc.wait()  # the fastest reaper there is: waitpid blocks until the exit
            wait_until(lambda r=rank, p=proc.pid: sample(
                registry, "robust_rank_exit_timestamp_seconds", run="r", rank=str(r),
                pid=str(p)) is not None,
                       timeout=5, message="exit seen")
            finished = sample(registry, "robust_rank_finished", run="r", rank=str(rank))
            assert finished == (1 if how == "terminate" else None), (rank, finished)
    finally:
        collector.exits.close()
        folder.close()


def test_process_events_are_parsed_per_process_not_per_thread() -> None:
    """A datagram holds netlink messages of 4-byte aligned length; only a thread-group leader's
    exit is a process exit, and its wait status carries the signal."""
    def message(what: int, pid: int, tgid: int, status: int, stamp: int = 0) -> bytes:
        event = struct.pack("=IIQ", what, 0, stamp) + struct.pack("=IIII", pid, tgid, status, 17)
        body = struct.pack("=IIIIHH", 1, 1, 0, 0, len(event), 0) + event
        return struct.pack("=IHHII", 16 + len(body), 3, 0, 0, 0) + body

    data = (message(0x80000000, 10, 10, signal.SIGTERM, 5_000)
            + message(0x80000000, 11, 10, 0) + message(0x00000001, 12, 12, 0)
            + message(0x80000000, 13, 13, 1 << 8, 7_000))
    assert proc_connector._exits_in(data) == [(10, signal.SIGTERM, 5_000), (13, 256, 7_000)]
    assert [proc_connector.signal_of(s) for _, s, _ in proc_connector._exits_in(data)] == [
        signal.SIGTERM, 0]


def test_an_exit_read_late_keeps_the_kernels_time() -> None:
    """The connector's events carry the kernel's time of the exit: read a second later, the
    exit is still dated when the process died."""
    _connector_or_skip()
    events = ProcExits.open()
    assert events is not None
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        killed_at = time.time()
        proc.kill()
        proc.wait()
        time.sleep(1.0)
        ours = [e for e in events.read() if e.tgid == proc.pid]
        assert len(ours) == 1 and proc_connector.signal_of(ours[0].status) == signal.SIGKILL
        assert abs(ours[0].at - killed_at) < 0.05, (ours[0].at - killed_at)
    finally:
        events.close()


def test_the_first_rank_to_die_is_first_even_when_the_sidecar_wakes_late(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 is killed; rank 1, its peer, writes its own crash time 5 ms after rank 0 is gone
    (what a gloo peer does when the connection resets, which the kernel does at the exit) and
    exits. A sidecar that wakes 50 ms late to the
    kill (a loaded node) must still date rank 0's exit first: the kernel's time of the exit,
    not the time the sidecar's clock read when it woke."""
    _connector_or_skip()
    late = 0.05
    monkeypatch.setattr(process_collector, "time",
                        types.SimpleNamespace(time=lambda: time.time() + late))
    (tmp_path / "ranks").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    folder = RankFiles(str(tmp_path), cache_seconds=0)
    collector = ProcessCollector(folder)
    try:
        started = time.time()
        for rank, proc in enumerate(procs):
            identity = {"run": "r", "rank": rank, "pid": proc.pid, "started": started}
            (tmp_path / "ranks" / f"{proc.pid}.json").write_text(json.dumps(identity))
        registry = registry_of(process=collector)
        assert sample(registry, "robust_rank_process_alive", run="r", rank="0") == 1
        killed_at = time.time()
        procs[0].kill()
        procs[0].wait()
        # (a loaded machine took 8 ms from the kill to the exit in CI: the peer's time follows
        # the exit, not the kill)
        crashed = time.time() + 0.005
        peer = {"run": "r", "rank": 1, "pid": procs[1].pid, "started": started,
                "crashed": crashed}
        (tmp_path / "ranks" / f"{procs[1].pid}.json").write_text(json.dumps(peer))
        time.sleep(max(0.0, crashed + 0.015 - time.time()))  # it dies after writing
        procs[1].kill()
        procs[1].wait()
        time.sleep(0.5)
        exits = [sample(registry, "robust_rank_exit_timestamp_seconds", run="r", rank=str(r),
                        pid=str(p.pid)) for r, p in enumerate(procs)]
        assert exits[1] == crashed
        assert exits[0] is not None and exits[0] < exits[1], (exits[0] - killed_at, exits)
    finally:
        collector.exits.close()
        folder.close()
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_dead_ranks_global_step_outlives_it_and_its_files(tmp_path: Path) -> None:
    """A rank that steps faster than the scrapes and dies (SIGKILL) right after its last step:
    no scrape saw that step alive, but its files hold it. The sidecar publishes it as the exit
    step, beside the exit time, and keeps it after merging the dead files away, until a new
    process of the rank replaces the dead one."""
    (tmp_path / "ranks").mkdir()
    script = (
        "import os, sys, time\n"
        "from robust_metrics import schema\n"
        "from robust_metrics.hooks.sinks import MultiprocessSink\n"
        "from robust_metrics.hooks.metric_store import MetricStore\n"
        "store = MetricStore({'run': 'r', 'rank': '1'})\n"
        "sink = MultiprocessSink(sys.argv[1])\n"
        "for step in range(1, 10):\n"
        "    store.series(schema.GLOBAL_STEP).set(step)\n"
        "    sink.flush(store)\n"
        "    time.sleep(0.01)\n"
        "print('stepped', flush=True)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        (tmp_path / "ranks" / f"{proc.pid}.json").write_text(json.dumps(
            {"run": "r", "rank": 1, "pid": proc.pid, "started": time.time()}))
        assert proc.stdout is not None and proc.stdout.readline().strip() == "stepped"
        proc.kill()
        proc.wait()
        folder = RankFiles(str(tmp_path), cache_seconds=0, merge_after=0)
        registry = registry_of(process=ProcessCollector(folder), ranks=RanksCollector(folder))
        assert sample(registry, "robust_global_step", run="r", rank="1") is None  # gauges go
        assert sample(registry, "robust_rank_exit_global_step", run="r", rank="1") == 9
        assert not list(tmp_path.glob(f"gauge_*_{proc.pid}.db")), "the dead files were merged"
        assert sample(registry, "robust_rank_exit_global_step", run="r", rank="1") == 9
        (tmp_path / "ranks" / f"{os.getpid()}.json").write_text(json.dumps(
            {"run": "r", "rank": 1, "pid": os.getpid(), "started": time.time() + 1}))
        assert sample(registry, "robust_rank_exit_global_step", run="r", rank="1") is None
        folder.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_that_wrote_until_it_died_is_dated_by_its_last_write() -> None:
    """The kernel reports a killed rank's exit after its sockets closed, and a peer that sees
    them close can stamp its exception first: a rank that wrote its files until it died is
    dated by its last write, which is before its death and so before any peer's exception."""
    ident = RankIdentity(pid=7, run="r", rank="0", started=100.0, flush_interval=0.25)
    assert exit_time(seen=150.05, ident=ident, written=149.9) == 149.9
    peer = RankIdentity(pid=8, run="r", rank="1", started=100.0, flush_interval=0.25,
                        crashed=150.01)
    assert exit_time(seen=150.03, ident=peer, written=149.95) == 150.01
    # a rank whose writes had stopped (stopped, hung in the kernel) exited when it was seen to
    assert exit_time(seen=150.05, ident=ident, written=140.0) == 150.05
    # the folder is the job's: a write before the start or after the exit is no time
    assert exit_time(seen=150.05, ident=ident, written=99.0) == 150.05
    assert exit_time(seen=150.05, ident=ident, written=151.0) == 150.05
    assert exit_time(seen=150.05, ident=ident) == 150.05


def test_an_exit_time_stays_once_the_dead_ranks_files_are_gone(tmp_path: Path) -> None:
    """A rank writing every 50 ms is killed: its exit is dated by its last write, and stays so
    after its files are merged away (a time that moved could move the run's first crash)."""
    writer = ROOT / "tests" / "fixtures" / "sidecar" / "rank_writer.py"
    proc = subprocess.Popen([sys.executable, str(writer), "--dir", str(tmp_path), "--forever",
                             "--interval", "0.05"], stdout=subprocess.PIPE, text=True)
    folder = RankFiles(str(tmp_path), cache_seconds=0)
    collector = ProcessCollector(folder)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("ready")
        registry = registry_of(process=collector)
        assert sample(registry, "robust_rank_process_alive", run="writer-run", rank="0") == 1
        time.sleep(0.3)
        killed_at = time.time()
        proc.kill()
        proc.wait()
        time.sleep(1.5)  # a scrape well after the writes went stale
        exited = sample(registry, "robust_rank_exit_timestamp_seconds", run="writer-run",
                        rank="0", pid=str(proc.pid))
        assert exited is not None and killed_at - 0.2 < exited <= killed_at, exited - killed_at
        for db in tmp_path.glob(f"*_{proc.pid}.db"):
            db.unlink()
        assert sample(registry, "robust_rank_exit_timestamp_seconds", run="writer-run",
                      rank="0", pid=str(proc.pid)) == exited
    finally:
        collector.exits.close()
        folder.close()
        proc.kill()
        proc.wait()


def test_step_age_is_as_of_the_last_write_while_the_rank_writes() -> None:
    """A job that steps every 0.05 s writes its files every 0.25 s: between writes the sidecar
    cannot see the steps taken since, so the age counts to the last write, not to the scrape."""
    assert step_age(now=100.8, since=100.0, written=100.2) == pytest.approx(0.2)
    # writes stopped (a stopped process): the age grows on the sidecar's clock
    assert step_age(now=105.0, since=100.0, written=100.2) == pytest.approx(5.0)
    # a hook that writes every 2 s is stale only after 3 of its intervals
    assert step_age(now=105.0, since=100.0, written=100.2, flush_interval=2.0) == pytest.approx(0.2)
    # the folder is the job's: a write time before the step or in the future is ignored
    assert step_age(now=101.0, since=100.0, written=99.0) == pytest.approx(1.0)
    assert step_age(now=101.0, since=100.0, written=200.0) == pytest.approx(1.0)
    assert step_age(now=101.0, since=100.0, written=None) == pytest.approx(1.0)


def test_the_sidecar_reads_the_step_age_at_the_ranks_last_write(tmp_path: Path) -> None:
    """The files are written 0.3 s after the last step, and scraped 0.6 s after that: the age is
    what the rank knew when it wrote (0.3 s), with the wait for the scrape left out."""
    store = MetricStore({"run": "r", "rank": "0"})
    sink = MultiprocessSink(str(tmp_path))
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / f"{os.getpid()}.json").write_text(json.dumps(
        {"run": "r", "rank": 0, "pid": os.getpid(), "started": time.time() - 5,
         "flush_interval": 0.25}))
    folder = RankFiles(str(tmp_path), cache_seconds=0)
    registry = registry_of(process=ProcessCollector(folder))
    try:
        stepped = time.time()
        store.series(schema.LAST_STEP_TIMESTAMP).set(stepped)
        time.sleep(0.3)
        sink.flush(store)
        written = max(p.stat().st_mtime for p in tmp_path.glob("*.db"))
        time.sleep(0.6)
        age = sample(registry, "robust_rank_step_age_seconds", run="r", rank="0")
        assert age == pytest.approx(written - stepped, abs=1e-3)
        assert 0.29 <= age < 0.6
        time.sleep(WRITES_STALE_AFTER)  # no write since: the age grows with the clock
        age = sample(registry, "robust_rank_step_age_seconds", run="r", rank="0")
        assert age is not None and age >= 0.3 + 0.6 + WRITES_STALE_AFTER
    finally:
        sink.close(store)
        folder.close()
