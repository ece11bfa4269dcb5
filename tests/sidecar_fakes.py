"""Fakes at library boundaries for the sidecar tests: NVML (the pynvml module) and NCCL's RAS port.

`FakeNvml` implements the pynvml functions the nvml collector calls, with per-GPU values a test can
change, NVMLError raised exactly as pynvml raises it (`pynvml.NVMLError(code)` builds the matching
subclass), GPUs that fall off the bus, a missing driver, and XID events for the event-set thread.
`FakeRasServer` is a real TCP server that speaks the RAS client protocol and answers STATUS with a
fixture report.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util: int = 87
    mem_used: int = 40 << 30
    mem_total: int = 80 << 30
    temperature: int = 61
    power_mw: int = 350_000
    energy_mj: int = 9_000_000
    sm_mhz: int = 1980
    mem_mhz: int = 2619
    throttle: int = 0x4 | 0x40  # sw_power_cap + hw_thermal_slowdown
    ecc: tuple[int, int] = (12, 0)
    remap: tuple[int, int, int, int] = (0, 0, 1, 0)
    pcie_replays: int = 5
    nvlinks: dict[int, dict[int, int]] = field(default_factory=lambda: {
        0: {0: 1, 1: 0, 2: 3, 3: 0}, 1: {0: 0, 1: 0, 2: 0, 3: 0}})
    pids: list[int] = field(default_factory=list)
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)


class FakeNvml:
    """The subset of pynvml the collector uses; errors are pynvml's own exception classes."""

    NVMLError = NVMLError
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = False
        self.events: queue.Queue[tuple[int, int]] = queue.Queue()
        self.calls = 0

    # lifecycle
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check(index, "handle")
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def _check(self, handle: int, what: str) -> FakeGpu:
        self.calls += 1
        gpu = self.gpus[handle]
        if gpu.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if what in gpu.unsupported:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # values
    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._check(h, "uuid").uuid

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._check(h, "name").name

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self._check(h, "util").util, memory=30)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        g = self._check(h, "memory")
        return SimpleNamespace(used=g.mem_used, total=g.mem_total, free=g.mem_total - g.mem_used)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._check(h, "temperature").temperature

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._check(h, "power").power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self._check(h, "energy").energy_mj

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        g = self._check(h, "clock")
        return {pynvml.NVML_CLOCK_SM: g.sm_mhz, pynvml.NVML_CLOCK_MEM: g.mem_mhz}[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._check(h, "throttle").throttle

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert counter == pynvml.NVML_VOLATILE_ECC
        return self._check(h, "ecc").ecc[kind]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._check(h, "remap").remap

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._check(h, "pcie").pcie_replays

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        g = self._check(h, "nvlink")
        if link >= 4:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1 if link in g.nvlinks else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        return self._check(h, "nvlink").nvlinks[link][counter]

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30)
                for p in self._check(h, "procs").pids]

    # XID events
    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        assert types & pynvml.nvmlEventTypeXidCriticalError
        self._check(h, "events")

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        try:
            gpu, xid = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        return SimpleNamespace(device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError,
                               eventData=xid)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass


class FakeRasServer:
    """Speaks NCCL's RAS client protocol on a loopback port; `json_report=None` mimics NCCL 2.24
    (no JSON: `SET FORMAT` is an unknown command)."""

    def __init__(self, text_report: str, json_report: str | None = None) -> None:
        self.text_report = text_report
        self.json_report = json_report
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.commands: list[str] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                self._client(conn)

    def _client(self, conn: socket.socket) -> None:
        fmt = "text"
        reader = conn.makefile("rb")
        for raw in reader:
            cmd = raw.decode().strip()
            self.commands.append(cmd)
            upper = cmd.upper()
            if upper.startswith("CLIENT PROTOCOL "):
                conn.sendall(b"SERVER PROTOCOL 2\n")
            elif upper.startswith("TIMEOUT "):
                conn.sendall(b"OK\n")
            elif upper.startswith("SET FORMAT ") and self.json_report is not None:
                fmt = cmd.split()[-1].lower()
                conn.sendall(b"OK\n")
            elif upper in ("STATUS", "VERBOSE STATUS"):
                report = self.json_report if fmt == "json" else self.text_report
                conn.sendall(report.encode())
                return
            else:
                conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())

    def close(self) -> None:
        """Stop listening now: shutdown wakes the accept() blocked in the server thread."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)
