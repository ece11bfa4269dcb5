"""`nvml`: per-GPU health and load through NVML (the `pynvml` module of nvidia-ml-py).

A GPU that fell off the bus cannot report itself, and a driver that is missing must not take the
sidecar down: `robust_nvml_up` says whether NVML initialised (retried every `--nvml-retry` seconds),
`robust_gpu_lost` whether a GPU answers NVML_ERROR_GPU_IS_LOST, and every other GPU keeps its series.
Each value is read on its own, so a field a GPU does not support (NOT_SUPPORTED) costs that series
only. XID events arrive through an NVML event set in a background thread and are counted by code.
Which GPU each rank uses comes from the GPU's running compute processes matched to
`ranks/<pid>.json`. Each GPU's peak FLOP/s (the MFU denominator) comes from its NVML name through
`robust_metrics.sidecar.gpu_peaks`, in `--gpu-peak-dtype`, overridable by `--gpu-peak-flops`.
Each rank that counts model FLOPs also gets the peak of its own GPU (`robust_rank_gpu_peak_flops`):
the node knows which GPU a rank uses, and joining 16,384 ranks to their GPUs in a rule costs
Prometheus more than every other MFU rule together. A rank NVML does not see (a container that
hides its pid) is taken to use the GPU numbered as its local rank.

The NVML module is a constructor argument so tests pass a fake at the pynvml boundary.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.sidecar.collectors.registry import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.gpu_peaks import parse_overrides, peak_flops
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = ["NVLINK_ERRORS", "THROTTLE_REASONS", "NvmlCollector"]

log = logging.getLogger(__name__)

# clock event (throttle) reason bits of nvmlDeviceGetCurrentClocksEventReasons
THROTTLE_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
# NVML_NVLINK_ERROR_DL_* counter ids
NVLINK_ERRORS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}
NVLINK_STATE_REFRESH = 60.0  # link states rarely change; probing 18 links per GPU costs time

ERROR_NOT_SUPPORTED = 3
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


class _GpuLost(Exception):
    pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _XidWatcher(threading.Thread):
    """Waits on an NVML event set and counts XID events by (gpu index, xid code)."""

    def __init__(self, nvml: Any, count: int) -> None:
        super().__init__(name="robust-metrics-xid", daemon=True)
        self.nvml = nvml
        self.count = count
        self.counts: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self) -> None:
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("NVML events unavailable, XIDs not counted: %s", exc)
            return
        registered = 0
        for index in range(self.count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, XID_EVENT, event_set)
                registered += 1
            except nvml.NVMLError as exc:
                log.info("GPU %d: XID events not registered: %s", index, exc)
        while registered and not self.stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, 500)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != ERROR_TIMEOUT:
                    log.debug("NVML event wait failed: %s", exc)
                    self.stop.wait(1.0)
                continue
            try:
                gpu = str(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                gpu = ""
            with self.lock:
                self.counts[(gpu, str(int(data.eventData)))] += 1
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlEventSetFree(event_set)

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self.lock:
            return dict(self.counts)


class NvmlCollector:
    def __init__(self, node: str, folder: RankFiles | None = None, *, nvml: Any = None,
                 retry_seconds: float = 60.0, xid_events: bool = True,
                 clock: Callable[[], float] = time.monotonic, peak_dtype: str = "bf16",
                 peak_overrides: Sequence[tuple[str, float]] = ()) -> None:
        self.node = node
        self.folder = folder
        self.retry_seconds = retry_seconds
        self.xid_events = xid_events
        self.peak_dtype = peak_dtype
        self.peak_overrides = tuple(peak_overrides)
        self._nvml = nvml
        self._clock = clock
        self._up = False
        self._last_try: float | None = None
        self._xid: _XidWatcher | None = None
        self._links: dict[int, tuple[float, list[int]]] = {}
        self._identity: dict[int, tuple[str, str]] = {}

    # -- NVML lifecycle --------------------------------------------------------------------
    def _module(self) -> Any:
        if self._nvml is None:
            import pynvml  # nvidia-ml-py; a missing package reads as NVML down

            self._nvml = pynvml
        return self._nvml

    def _ensure_up(self) -> bool:
        if self._up:
            return True
        now = self._clock()
        if self._last_try is not None and now - self._last_try < self.retry_seconds:
            return False
        self._last_try = now
        try:
            nvml = self._module()
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except ImportError as exc:
            log.warning("nvml: pynvml is not installed (pip install nvidia-ml-py): %s", exc)
            return False
        except Exception as exc:  # NVMLError: no driver, no library, no permission
            log.info("nvml: NVML did not initialise: %s", exc)
            return False
        self._up = True
        if self.xid_events and self._xid is None:
            self._xid = _XidWatcher(nvml, count)
            self._xid.start()
        return True

    def close(self) -> None:
        if self._xid is not None:
            self._xid.stop.set()
            self._xid.join(timeout=2)
            self._xid = None
        if self._up:
            with contextlib.suppress(Exception):
                self._module().nvmlShutdown()
            self._up = False

    # -- scrape ----------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        s = schema
        up = GaugeMetricFamily(s.NVML_UP.name, s.NVML_UP.help, labels=["node"])
        ok = self._ensure_up()
        count = 0
        if ok:
            try:
                count = self._module().nvmlDeviceGetCount()
            except Exception as exc:
                log.warning("nvml: device count failed, re-initialising later: %s", exc)
                self._up, ok = False, False
        up.add_metric([self.node], 1.0 if ok else 0.0)
        yield up
        if not ok:
            return
        yield from self._devices(count)

    def _devices(self, count: int) -> Iterator[Metric]:
        s = schema
        nvml = self._module()
        gpu_labels = ["node", "gpu"]

        def gauge(spec: schema.MetricSpec, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(spec.name, spec.help, labels=[*gpu_labels, *extra])

        def counter(spec: schema.MetricSpec, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(spec.name, spec.help, labels=[*gpu_labels, *extra])

        info = gauge(s.GPU_INFO, ("uuid", "name"))
        peak = gauge(s.GPU_PEAK_FLOPS)
        lost = gauge(s.GPU_LOST)
        util = gauge(s.GPU_UTILIZATION)
        mem_used, mem_total = gauge(s.GPU_MEMORY_USED), gauge(s.GPU_MEMORY_TOTAL)
        temp, power = gauge(s.GPU_TEMPERATURE), gauge(s.GPU_POWER)
        energy = counter(s.GPU_ENERGY)
        sm_clock, mem_clock = gauge(s.GPU_SM_CLOCK), gauge(s.GPU_MEMORY_CLOCK)
        throttle = gauge(s.GPU_THROTTLE, ("reason",))
        ecc = counter(s.GPU_ECC_ERRORS, ("type",))
        remap_pending, remap_failure = gauge(s.GPU_ROW_REMAP_PENDING), gauge(s.GPU_ROW_REMAP_FAILURE)
        pcie = counter(s.GPU_PCIE_REPLAYS)
        nvlink = counter(s.GPU_NVLINK_ERRORS, ("link", "type"))
        xid = counter(s.GPU_XID_ERRORS, ("xid",))
        rank_gpu = GaugeMetricFamily(s.RANK_GPU_INFO.name, s.RANK_GPU_INFO.help,
                                     labels=["run", "rank", "node", "gpu", "uuid"])
        ranks, counting = self._ranks()
        peaks: dict[str, float] = {}  # GPU index -> peak, for GPUs read whole
        rank_gpus: dict[tuple[str, str], set[str]] = {}  # (run, rank) -> GPUs NVML sees it on

        for index in range(count):
            gpu = str(index)
            labels = [self.node, gpu]
            pending: list[tuple[Metric, list[str], float]] = []

            def put(family: Metric, values: list[str], value: float,
                    pending: list[tuple[Metric, list[str], float]] = pending) -> None:
                pending.append((family, values, value))

            try:
                handle = self._call(nvml.nvmlDeviceGetHandleByIndex, index)
                if handle is None:
                    continue
                uuid = _text(self._call(nvml.nvmlDeviceGetUUID, handle) or "")
                name = _text(self._call(nvml.nvmlDeviceGetName, handle) or "")
                put(info, [*labels, uuid, name], 1.0)
                flops = peak_flops(name, self.peak_dtype, self.peak_overrides)
                if flops is not None:
                    put(peak, labels, flops)
                rates = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
                if rates is not None:
                    put(util, labels, rates.gpu / 100.0)
                memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
                if memory is not None:
                    put(mem_used, labels, float(memory.used))
                    put(mem_total, labels, float(memory.total))
                self._add(put, temp, labels, nvml.nvmlDeviceGetTemperature, handle, 0)
                self._add(put, power, labels, nvml.nvmlDeviceGetPowerUsage, handle, scale=1e-3)
                self._add(put, energy, labels, nvml.nvmlDeviceGetTotalEnergyConsumption, handle,
                          scale=1e-3)
                self._add(put, sm_clock, labels, nvml.nvmlDeviceGetClockInfo, handle, 1, scale=1e6)
                self._add(put, mem_clock, labels, nvml.nvmlDeviceGetClockInfo, handle, 2, scale=1e6)
                reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                    nvml.nvmlDeviceGetCurrentClocksThrottleReasons
                mask = self._call(reasons_fn, handle)
                if mask is not None:
                    for reason, bit in THROTTLE_REASONS.items():
                        put(throttle, [*labels, reason], 1.0 if int(mask) & bit else 0.0)
                for kind, code in (("corrected", 0), ("uncorrected", 1)):
                    value = self._call(nvml.nvmlDeviceGetTotalEccErrors, handle, code, 0)
                    if value is not None:
                        put(ecc, [*labels, kind], float(value))
                remap = self._call(nvml.nvmlDeviceGetRemappedRows, handle)
                if remap is not None:
                    put(remap_pending, labels, float(bool(remap[2])))
                    put(remap_failure, labels, float(bool(remap[3])))
                self._add(put, pcie, labels, nvml.nvmlDeviceGetPcieReplayCounter, handle)
                for link in self._active_links(index, handle):
                    for kind, code in NVLINK_ERRORS.items():
                        value = self._call(nvml.nvmlDeviceGetNvLinkErrorCounter, handle, link, code)
                        if value is not None:
                            put(nvlink, [*labels, str(link), kind], float(value))
                procs = self._call(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
                users = {ranks[int(proc.pid)] for proc in procs if int(proc.pid) in ranks}
                for who in sorted(users):
                    put(rank_gpu, [who[0], who[1], self.node, gpu, uuid], 1.0)
            except _GpuLost:  # a GPU that vanished mid-read keeps none of its values
                lost.add_metric(labels, 1.0)
                continue
            lost.add_metric(labels, 0.0)
            if flops is not None:
                peaks[gpu] = flops
            for who in users:
                rank_gpus.setdefault(who, set()).add(gpu)
            for family, values, value in pending:
                family.add_metric(values, value)  # type: ignore[attr-defined]
        if self._xid is not None:
            for (gpu, code), value in sorted(self._xid.snapshot().items()):
                xid.add_metric([self.node, gpu, code], float(value))
        rank_peak = GaugeMetricFamily(s.RANK_GPU_PEAK_FLOPS.name, s.RANK_GPU_PEAK_FLOPS.help,
                                      labels=["run", "rank"])
        for who, local_rank in sorted(counting.items()):
            known = [peaks[g] for g in rank_gpus.get(who, {local_rank}) if g in peaks]
            if known:
                rank_peak.add_metric(list(who), max(known))
        yield from (info, peak, lost, util, mem_used, mem_total, temp, power, energy, sm_clock,
                    mem_clock, throttle, ecc, remap_pending, remap_failure, pcie, nvlink, xid,
                    rank_gpu, rank_peak)

    def _ranks(self) -> tuple[dict[int, tuple[str, str]], dict[tuple[str, str], str]]:
        """Live ranks by pid as (run, rank), and the local rank of each live rank that counts
        model FLOPs (its files hold robust_model_flops_total)."""
        if self.folder is None:
            return {}, {}
        snapshot = self.folder.snapshot()
        live = {pid: i for pid, i in snapshot.identities.items() if snapshot.alive.get(pid)}
        flops = schema.MODEL_FLOPS.name
        counted = {(sample.labels.get("run", ""), sample.labels.get("rank", ""))
                   for family in snapshot.families for sample in family.samples
                   if sample.name == flops}
        local = {(i.run, i.rank): i.local_rank for i in live.values()}
        return ({pid: (i.run, i.rank) for pid, i in live.items()},
                {who: local[who] for who in counted if who in local})

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args); None when the GPU does not support it; _GpuLost when the GPU is gone."""
        nvml = self._module()
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == ERROR_GPU_IS_LOST:
                raise _GpuLost from exc
            if getattr(exc, "value", None) != ERROR_NOT_SUPPORTED:
                log.debug("nvml: %s%r failed: %s", getattr(fn, "__name__", fn), args[1:], exc)
            return None

    def _add(self, put: Callable[[Metric, list[str], float], None], family: Metric,
             labels: list[str], fn: Callable[..., Any], *args: Any, scale: float = 1.0) -> None:
        value = self._call(fn, *args)
        if value is not None:
            put(family, labels, float(value) * scale)

    def _active_links(self, index: int, handle: Any) -> list[int]:
        """NVLinks that are up, re-probed every NVLINK_STATE_REFRESH seconds."""
        now = self._clock()
        cached = self._links.get(index)
        if cached is not None and now - cached[0] < NVLINK_STATE_REFRESH:
            return cached[1]
        nvml = self._module()
        links = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link):
                    links.append(link)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) == ERROR_GPU_IS_LOST:
                    raise _GpuLost from exc
                if link == 0:
                    break  # no NVLink on this GPU
        self._links[index] = (now, links)
        return links


@register_collector("nvml", default_enabled=True,
                    help="GPU health and load through NVML (nvidia-ml-py)")
def _factory(config: SidecarConfig, folder: RankFiles) -> NvmlCollector:
    return NvmlCollector(config.node, folder, retry_seconds=config.nvml_retry,
                         peak_dtype=config.gpu_peak_dtype,
                         peak_overrides=parse_overrides(config.gpu_peak_flops))
