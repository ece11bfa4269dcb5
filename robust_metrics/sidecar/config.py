"""Settings of the node sidecar, checked once at start-up.

The listen address defaults to loopback (`127.0.0.1:9741`): the sidecar can dump stacks and trigger
checkpoints, so exposing it is a decision (`--listen 0.0.0.0:9741` plus a token file and a web
config), not an accident.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from robust_metrics.configuration import ConfigError
from robust_metrics.numbers import decimal

__all__ = ["DEFAULT_LISTEN", "DEFAULT_PORT", "ConfigError", "SidecarConfig", "parse_listen"]

DEFAULT_PORT = 9741
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_NCCL_RAS_ADDR = "localhost:28028"


def parse_listen(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPv6]:PORT` or `:PORT` (all interfaces) into (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        raise ConfigError(f"--listen {value!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"--listen {value!r}: port {port_text!r} is not a number") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"--listen {value!r}: port must be in 0..65535")
    return host, port


@dataclass
class SidecarConfig:
    """Resolved settings; `validate()` raises ConfigError naming the bad one."""

    directory: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    node: str = field(default_factory=socket.gethostname)
    collectors: list[str] = field(default_factory=list)
    web_config: str | None = None
    token_file: str | None = None
    sysfs: str = "/sys"
    nccl_ras_addr: str = field(
        default_factory=lambda: os.environ.get("NCCL_RAS_ADDR") or DEFAULT_NCCL_RAS_ADDR)
    nccl_interval: float = 30.0
    merge_after: float = 60.0
    retention: float = 600.0
    stacks_timeout: float = 10.0
    nvml_retry: float = 60.0
    collector_timeout: float = 5.0
    gpu_peak_dtype: str = "bf16"
    gpu_peak_flops: list[str] = field(default_factory=list)
    selftest_timeout: float = 300.0
    selftest_args: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if not self.directory:
            raise ConfigError("--dir: the ranks' metrics folder (ROBUST_METRICS_DIR) is required")
        if not self.node or any(c in self.node for c in '\n"\\'):
            raise ConfigError(f"--node {self.node!r}: must be a non-empty label value")
        for name in ("nccl_interval", "merge_after", "retention", "stacks_timeout", "nvml_retry",
                     "collector_timeout", "selftest_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r}: must be seconds >= 0")
        if self.nccl_interval <= 0 or self.stacks_timeout <= 0 or self.collector_timeout <= 0 \
                or self.selftest_timeout <= 0:
            raise ConfigError("--nccl-interval, --stacks-timeout, --collector-timeout and "
                              "--selftest-timeout must be > 0")
        from robust_metrics.sidecar.gpu_peaks import DTYPES, parse_overrides

        if self.gpu_peak_dtype not in DTYPES:
            raise ConfigError(f"--gpu-peak-dtype {self.gpu_peak_dtype!r}: choose one of "
                              f"{', '.join(DTYPES)}")
        parse_overrides(self.gpu_peak_flops)
        _, sep, port = self.nccl_ras_addr.rpartition(":")
        if not sep or decimal(port) is None:
            raise ConfigError(f"NCCL RAS address {self.nccl_ras_addr!r}: expected HOST:PORT")
