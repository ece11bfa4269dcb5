"""`nccl`: NCCL's RAS service (NCCL >= 2.24), asked what it knows about the job's communicators.

Every NCCL process listens on `NCCL_RAS_ADDR` (default `localhost:28028`) for clients such as
`ncclras`. Its STATUS report says how many communicators exist, which ranks are missing or
unresponsive and which have initialisation or asynchronous errors: a view of a hang from inside
NCCL. A status query runs a collective over the RAS network and can take seconds, so it runs in a
background thread every `--nccl-interval` seconds and scrapes read the last answer.

Protocol: `CLIENT PROTOCOL 2` -> `SERVER PROTOCOL n`; `SET FORMAT json` -> `OK` on NCCL versions
with JSON output (older ones answer `ERROR` and we parse the text report); `TIMEOUT s` -> `OK`;
`STATUS` -> the report, then the server closes the connection.

Nothing listening is the normal case on a node without NCCL jobs: the collector then exports
nothing at all. Once the service has answered, `robust_nccl_ras_up` follows it (0 when it stops).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.numbers import decimal
from robust_metrics.sidecar.collectors.registry import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = ["NcclRasCollector", "RasError", "RasReport", "parse_json_report",
           "parse_text_report", "query_ras"]

log = logging.getLogger(__name__)

CLIENT_PROTOCOL = 2
NCCL_IN_PROGRESS = 7  # ncclInProgress: not an error
MAX_REPORT_BYTES = 16 << 20


class RasError(Exception):
    """The RAS service answered something this client does not understand."""


@dataclass(frozen=True)
class RasReport:
    communicators: int
    missing_ranks: int
    errors: int


def parse_text_report(text: str) -> RasReport:
    """Parse the text STATUS report (NCCL 2.24+).

    communicators: the sum of the "Comms in group" column of the communicators table;
    missing_ranks: the ranks named in "#g-i (...) INCOMPLETE / Missing communicator data from N
    ranks" blocks, or when there are none the job processes the Errors section calls missing or dead;
    errors: ranks with initialisation plus ranks with asynchronous errors.
    """
    lines = text.splitlines()
    communicators = 0
    in_table = False
    seen_table = False
    for line in lines:
        if line.startswith("Group") and "Comms" in line:
            in_table = seen_table = True
            continue
        if in_table:
            fields = line.split()
            if not fields:
                in_table = False
            elif len(fields) >= 2 and decimal(fields[0]) is not None:
                communicators += decimal(fields[1]) or 0
    if not seen_table and "No communicator data collected" not in text:
        raise RasError("report has no communicators table")
    comm_missing = sum(int(n) for n in re.findall(
        r"^#\d+-\d+ \([0-9a-fA-F]+\) INCOMPLETE\s*\n\s*Missing communicator data from (\d+) rank",
        text, re.MULTILINE))
    if comm_missing:
        missing = comm_missing
    else:
        missing = sum(int(n) for n in re.findall(
            r"Missing communicator data from (\d+) job process", text))
        missing += sum(int(n) for n in re.findall(
            r"(\d+) job process(?:es are| is) considered dead", text))
    errors = sum(int(n) for n in re.findall(
        r"(?:Initialization|Asynchronous) errors? on (\d+) ranks?", text))
    return RasReport(communicators, missing, errors)


def parse_json_report(text: str) -> RasReport:
    """Parse the JSON STATUS report (NCCL versions that accept `SET FORMAT json`)."""
    try:
        data = json.loads(text)
        comms = data.get("communicators", [])
        count = int(data.get("communicators_count", len(comms)))
        missing = errors = 0
        for comm in comms:
            for rank in comm.get("missing_ranks", []):
                status = rank.get("status", {})
                if status.get("unresponsive") or status.get("considered_dead"):
                    missing += 1
            for rank in comm.get("ranks", []):
                status = rank.get("status", {})
                for field in ("init_state", "async_error"):
                    if int(status.get(field, 0)) not in (0, NCCL_IN_PROGRESS):
                        errors += 1
    except (ValueError, TypeError, AttributeError) as exc:
        raise RasError(f"unreadable JSON report: {exc}") from None
    return RasReport(count, missing, errors)


def _read_line(sock: socket.socket, buffer: bytearray) -> str:
    while b"\n" not in buffer:
        chunk = sock.recv(4096)
        if not chunk:
            raise RasError("connection closed during the handshake")
        buffer += chunk
        if len(buffer) > 65536:
            raise RasError("handshake line too long")
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line.decode(errors="replace").strip()


def query_ras(host: str, port: int, timeout: float = 5.0, collective_timeout: int = 3
              ) -> RasReport:
    """One STATUS query. ConnectionRefusedError means nothing listens; RasError a bad answer."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        buffer = bytearray()
        sock.sendall(f"CLIENT PROTOCOL {CLIENT_PROTOCOL}\n".encode())
        hello = _read_line(sock, buffer)
        if not hello.upper().startswith("SERVER PROTOCOL"):
            raise RasError(f"unexpected handshake {hello[:80]!r}")
        sock.sendall(b"SET FORMAT json\n")
        use_json = _read_line(sock, buffer).upper() == "OK"
        sock.sendall(f"TIMEOUT {collective_timeout}\n".encode())
        answer = _read_line(sock, buffer)
        if answer.upper() != "OK":
            raise RasError(f"TIMEOUT refused: {answer[:80]!r}")
        sock.settimeout(timeout + collective_timeout + 2)
        sock.sendall(b"STATUS\n")
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buffer += chunk
            if len(buffer) > MAX_REPORT_BYTES:
                raise RasError("report larger than 16 MiB")
    text = buffer.decode(errors="replace")
    return parse_json_report(text) if use_json else parse_text_report(text)


class NcclRasCollector:
    def __init__(self, node: str, addr: str, interval: float = 30.0, *,
                 background: bool = True) -> None:
        """`background=False` leaves querying to explicit `refresh()` calls (tests)."""
        host, _, port = addr.rpartition(":")
        self.node = node
        self.host = host.strip("[]") or "localhost"
        self.port = int(port)
        self.interval = interval
        self.background = background
        self.seen = False  # has anything ever listened there?
        self.up = False
        self.report: RasReport | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        """Query once now (the background thread calls this every interval)."""
        try:
            report = query_ras(self.host, self.port)
        except ConnectionRefusedError:
            with self._lock:
                self.up = False
            return
        except (OSError, RasError) as exc:
            log.info("NCCL RAS at %s:%d did not answer: %s", self.host, self.port, exc)
            with self._lock:
                self.seen, self.up = True, False
            return
        with self._lock:
            self.seen, self.up, self.report = True, True, report

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.interval)

    def start(self) -> None:
        if self._thread is None and self.background:
            self._thread = threading.Thread(target=self._loop, name="robust-metrics-nccl-ras",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def collect(self) -> Iterator[Metric]:
        self.start()
        with self._lock:
            seen, up, report = self.seen, self.up, self.report
        if not seen:
            return
        s = schema
        labels = ["node"]
        up_f = GaugeMetricFamily(s.NCCL_RAS_UP.name, s.NCCL_RAS_UP.help, labels=labels)
        up_f.add_metric([self.node], 1.0 if up else 0.0)
        yield up_f
        if not up or report is None:
            return
        for spec, value in ((s.NCCL_COMMUNICATORS, report.communicators),
                            (s.NCCL_MISSING_RANKS, report.missing_ranks),
                            (s.NCCL_ERRORS, report.errors)):
            family = GaugeMetricFamily(spec.name, spec.help, labels=labels)
            family.add_metric([self.node], float(value))
            yield family


@register_collector("nccl", default_enabled=True,
                    help="NCCL RAS service status (exports nothing while nothing listens)")
def _factory(config: SidecarConfig, folder: RankFiles) -> NcclRasCollector:
    return NcclRasCollector(config.node, config.nccl_ras_addr, config.nccl_interval)
