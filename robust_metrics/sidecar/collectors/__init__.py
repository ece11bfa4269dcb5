"""One collector per module; importing this package registers them all (see `..collector`)."""

from robust_metrics.sidecar.collectors import nccl_ras, nic, nvml, process, ranks, selftest

__all__ = ["nccl_ras", "nic", "nvml", "process", "ranks", "selftest"]
