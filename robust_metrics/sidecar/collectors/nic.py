"""`nic`: InfiniBand/RoCE ports and network device carrier, read from sysfs.

A flapping or degraded link shows up as a slow collective on every rank of the job; only the node
sees which port. Per port of `<sysfs>/class/infiniband/<device>/ports/<port>/`: whether the state is
ACTIVE, the link rate, bytes sent and received and the error counters; per physical network device
(`<sysfs>/class/net/<if>` with a `device` link): carrier and carrier changes. The sysfs root is a
setting (`--path.sysfs`), so tests read a fixture tree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.sidecar.collectors.registry import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = ["ERROR_COUNTERS", "NicCollector", "parse_rate"]

# port counters (counters/<name>) exported as robust_nic_port_errors_total{counter=<name>}
ERROR_COUNTERS = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_rcv_constraint_errors",
    "port_xmit_constraint_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
)
_RATE = re.compile(r"^\s*([0-9.]+)\s*([GM])b/sec")


def parse_rate(text: str) -> float | None:
    """`'200 Gb/sec (4X HDR)'` -> bytes per second; None when unparseable."""
    match = _RATE.match(text)
    if not match:
        return None
    bits = float(match.group(1)) * (1e9 if match.group(2) == "G" else 1e6)
    return bits / 8


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # absent, or EINVAL (carrier of a device that is down)
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:  # "N/A (no PMA)"
        return None


class NicCollector:
    def __init__(self, sysfs: str, node: str) -> None:
        self.sysfs = sysfs
        self.node = node

    def collect(self) -> Iterator[Metric]:
        yield from self._infiniband()
        yield from self._netdev()

    def _infiniband(self) -> Iterator[Metric]:
        s = schema
        labels = ["node", "device", "port"]
        up = GaugeMetricFamily(s.NIC_PORT_UP.name, s.NIC_PORT_UP.help, labels=labels)
        rate = GaugeMetricFamily(s.NIC_PORT_RATE.name, s.NIC_PORT_RATE.help, labels=labels)
        tx = CounterMetricFamily(s.NIC_TRANSMIT.name, s.NIC_TRANSMIT.help, labels=labels)
        rx = CounterMetricFamily(s.NIC_RECEIVE.name, s.NIC_RECEIVE.help, labels=labels)
        errors = CounterMetricFamily(s.NIC_ERRORS.name, s.NIC_ERRORS.help,
                                     labels=[*labels, "counter"])
        root = os.path.join(self.sysfs, "class", "infiniband")
        for device in _listdir(root):
            ports = os.path.join(root, device, "ports")
            for port in _listdir(ports):
                base = os.path.join(ports, port)
                values = [self.node, device, port]
                state = _read(os.path.join(base, "state"))
                if state is not None:  # "4: ACTIVE"
                    up.add_metric(values, 1.0 if state.endswith("ACTIVE") else 0.0)
                rate_text = _read(os.path.join(base, "rate"))
                rate_value = parse_rate(rate_text) if rate_text else None
                if rate_value is not None:
                    rate.add_metric(values, rate_value)
                counters = os.path.join(base, "counters")
                # port_xmit_data/port_rcv_data count 4-byte words (octets divided by 4)
                for family, name in ((tx, "port_xmit_data"), (rx, "port_rcv_data")):
                    words = _read_int(os.path.join(counters, name))
                    if words is not None:
                        family.add_metric(values, words * 4.0)
                for name in ERROR_COUNTERS:
                    value = _read_int(os.path.join(counters, name))
                    if value is not None:
                        errors.add_metric([*values, name], float(value))
        yield from (up, rate, tx, rx, errors)

    def _netdev(self) -> Iterator[Metric]:
        s = schema
        labels = ["node", "interface"]
        changes = CounterMetricFamily(s.NETDEV_CARRIER_CHANGES.name, s.NETDEV_CARRIER_CHANGES.help,
                                      labels=labels)
        up = GaugeMetricFamily(s.NETDEV_UP.name, s.NETDEV_UP.help, labels=labels)
        root = os.path.join(self.sysfs, "class", "net")
        for iface in _listdir(root):
            base = os.path.join(root, iface)
            if not os.path.exists(os.path.join(base, "device")):
                continue  # virtual (lo, veth, bridges): not a link that can flap physically
            value = _read_int(os.path.join(base, "carrier_changes"))
            if value is not None:
                changes.add_metric([self.node, iface], float(value))
            carrier = _read_int(os.path.join(base, "carrier"))
            up.add_metric([self.node, iface], 1.0 if carrier == 1 else 0.0)
        yield from (changes, up)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


@register_collector("nic", default_enabled=True,
                    help="InfiniBand/RoCE ports and network device carrier from sysfs")
def _factory(config: SidecarConfig, folder: RankFiles) -> NicCollector:
    return NicCollector(config.sysfs, config.node)
