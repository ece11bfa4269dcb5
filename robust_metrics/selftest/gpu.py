"""`gpu`: GPU health through NVML: XID events, uncorrected ECC errors, row remaps, throttling.

Why: a GPU that logged an XID, holds uncorrected ECC errors, has a row remap pending (a reset is
needed) or failed, or runs with its clocks held down by a hardware slowdown will fail or slow the
job again after a restart; the driver knows, so asking it costs milliseconds. The figure is the
number of problems found. XID events are only delivered while someone listens, so the check
listens for `xid_wait_s` (the sidecar's nvml collector counts them all the time, in
`robust_gpu_xid_errors_total`).

No GPU, no driver or no `pynvml` (nvidia-ml-py) makes the verdict `skipped` with the reason, never
`fail`: a CPU node is not a broken GPU node. The NVML module is an argument, so tests pass a fake
at the pynvml boundary; with the `gpu` fault NVML itself answers that a row remap is pending on GPU 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from robust_metrics.selftest.api import CheckResult

__all__ = ["BAD_THROTTLE", "GpuOptions", "run"]

# clock event reasons that mean the hardware is holding the clocks down, not the workload
BAD_THROTTLE = {"hw_slowdown": 0x8, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
                "hw_power_brake_slowdown": 0x80}
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
ERROR_GPU_IS_LOST = 15


class _Lost(Exception):
    pass


class _PendingRemap:
    """The NVML module with GPU 0 answering that a row remap is pending (the `gpu` fault)."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nvml, name)

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        rows = tuple(self._nvml.nvmlDeviceGetRemappedRows(handle))
        first = self._nvml.nvmlDeviceGetHandleByIndex(0)
        return (rows[0], rows[1], 1, rows[3]) if handle == first else rows  # type: ignore[return-value]


@dataclass(frozen=True)
class GpuOptions:
    xid_wait_s: float = 0.5


def _call(nvml: Any, fn_name: str, *args: Any) -> Any:
    """An NVML read; None when this GPU or driver does not offer it."""
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) == ERROR_GPU_IS_LOST:
            raise _Lost from exc
        return None


def _device_problems(nvml: Any, index: int, handle: Any) -> list[str]:
    problems = []
    ecc = _call(nvml, "nvmlDeviceGetTotalEccErrors", handle, 1, 0)  # uncorrected, volatile
    if ecc:
        problems.append(f"GPU {index}: {int(ecc)} uncorrected ECC error(s) since the driver loaded")
    remap = _call(nvml, "nvmlDeviceGetRemappedRows", handle)
    if remap is not None and remap[2]:
        problems.append(f"GPU {index}: a row remap is pending (reset the GPU)")
    if remap is not None and remap[3]:
        problems.append(f"GPU {index}: a row remap failed (replace the GPU)")
    mask = _call(nvml, "nvmlDeviceGetCurrentClocksEventReasons", handle)
    if mask is None:
        mask = _call(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    for reason, bit in BAD_THROTTLE.items():
        if mask is not None and int(mask) & bit:
            problems.append(f"GPU {index}: clocks held down ({reason})")
    return problems


def _xids(nvml: Any, handles: list[Any], wait_s: float) -> list[str]:
    """XID events delivered while listening for `wait_s` seconds."""
    try:
        event_set = nvml.nvmlEventSetCreate()
    except nvml.NVMLError:
        return []
    found = []
    try:
        for handle in handles:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlDeviceRegisterEvents(handle, XID_EVENT, event_set)
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, int(wait_s * 1000))
            except nvml.NVMLError:
                break  # timeout: nothing (more) pending
            found.append(f"GPU {_call(nvml, 'nvmlDeviceGetIndex', data.device)}: "
                         f"XID {int(data.eventData)}")
            wait_s = 0.0
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlEventSetFree(event_set)
    return found


def _load(nvml: Any) -> tuple[Any, str | None]:
    if nvml is not None:
        return nvml, None
    try:
        import pynvml
    except ImportError:
        return None, "pynvml is not installed (pip install nvidia-ml-py)"
    return pynvml, None


def run(options: GpuOptions, fault: Mapping[str, str] | None = None,
        nvml: Any = None) -> CheckResult:
    """Ask NVML about every GPU; `skipped` when there is no NVML to ask."""
    nvml, why = _load(nvml)
    if nvml is None:
        return CheckResult("gpu", "skipped", None, "", str(why))
    if fault is not None:
        nvml = _PendingRemap(nvml)
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return CheckResult("gpu", "skipped", None, "", f"NVML did not initialise: {exc}")
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            return CheckResult("gpu", "skipped", None, "", "NVML sees no GPU on this node")
        handles, problems = [], []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                lost = getattr(exc, "value", None) == ERROR_GPU_IS_LOST
                problems.append(f"GPU {index}: " + ("lost (fallen off the bus)" if lost
                                                    else f"not accessible ({exc})"))
                continue
            try:
                problems += _device_problems(nvml, index, handle)
            except _Lost:
                problems.append(f"GPU {index}: lost (fallen off the bus)")
                continue
            handles.append(handle)
        problems += _xids(nvml, handles, options.xid_wait_s)
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    detail = "; ".join(problems) or f"{count} GPU(s): no XID, uncorrected ECC, row remap or " \
                                    "hardware throttling"
    return CheckResult("gpu", "fail" if problems else "pass", float(len(problems)), "",
                       detail, data={"gpus": count, "problems": problems})
