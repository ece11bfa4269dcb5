"""Runs the chosen checks in order and gathers one `Report` for the node.

A check that cannot run here (no torch, no NVML) is `skipped`, and so is one that raises an
unexpected exception (logged): a verdict of `fail` drains a node, so only evidence about the node
may produce it, never a bug of the check or a missing package.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from robust_metrics.selftest import communication, compute, gpu, memory
from robust_metrics.selftest.api import CHECKS, CheckResult, Report, faults

__all__ = ["SelftestOptions", "default_options", "run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelftestOptions:
    """Which checks run, and each check's options."""

    node: str = field(default_factory=socket.gethostname)
    checks: tuple[str, ...] = CHECKS
    compute: compute.ComputeOptions = field(default_factory=compute.ComputeOptions)
    memory: memory.MemoryOptions = field(default_factory=memory.MemoryOptions)
    communication: communication.CommunicationOptions = field(
        default_factory=communication.CommunicationOptions)
    gpu: gpu.GpuOptions = field(default_factory=gpu.GpuOptions)
    inject_fault: str | None = None


def _gpus() -> int:
    """CUDA devices torch sees (0 without torch or a GPU)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def default_options(quick: bool = False) -> dict[str, dict[str, Any]]:
    """Per-check option defaults: `quick` keeps a prolog within seconds (docs/selftest.md).

    With GPUs the compute check multiplies on GPU 0 and, with two or more GPUs, the local
    communication group is one NCCL rank per GPU; otherwise gloo ranks on the CPU cores."""
    gpus = _gpus()
    device = "cuda" if gpus else "cpu"
    nccl = gpus >= 2
    local_world = gpus if nccl else max(2, min(4, os.cpu_count() or 2))
    backend = "nccl" if nccl else "gloo"
    if quick:
        return {"compute": {"size": 4096 if gpus else 384, "repeats": 3, "device": device},
                "memory": {"size_bytes": 32 << 20},
                "communication": {"world_size": local_world if nccl else 2,
                                  "size_bytes": (64 << 20) if nccl else (1 << 20),
                                  "iterations": 3, "timeout_s": 30.0, "backend": backend},
                "gpu": {"xid_wait_s": 0.1}}
    return {"compute": {"size": 8192 if gpus else 1024, "repeats": 5, "device": device},
            "memory": {"size_bytes": 256 << 20},
            "communication": {"world_size": local_world,
                              "size_bytes": (256 << 20) if nccl else (16 << 20),
                              "iterations": 5, "backend": backend},
            "gpu": {"xid_wait_s": 0.5}}


def _runners(options: SelftestOptions) -> dict[str, Callable[[Mapping[str, str] | None],
                                                            CheckResult]]:
    return {"compute": lambda f: compute.run(options.compute, f),
            "memory": lambda f: memory.run(options.memory, f),
            "communication": lambda f: communication.run(options.communication, f),
            "gpu": lambda f: gpu.run(options.gpu, f)}


def _one(name: str, runner: Callable[[Mapping[str, str] | None], CheckResult],
         fault: Mapping[str, str] | None) -> CheckResult:
    started = time.perf_counter()
    try:
        result = runner(fault)
    except ModuleNotFoundError as exc:
        result = CheckResult(name, "skipped", None, "", f"{exc.name} is not installed "
                             "(pip install 'robust-metrics[torch]')")
    except Exception as exc:  # a bug of the check is no evidence against the node
        log.exception("self-test check %s raised", name)
        result = CheckResult(name, "skipped", None, "", f"the check itself failed: {exc!r}")
    took = time.perf_counter() - started
    return CheckResult(result.check, result.verdict, result.figure, result.unit, result.detail,
                       took, result.data)


def run(options: SelftestOptions) -> Report:
    """Run `options.checks` in order; faults come from the environment and `inject_fault`."""
    injected = faults(options.inject_fault)
    runners = _runners(options)
    started, t0 = time.time(), time.perf_counter()
    results = tuple(_one(name, runners[name], injected.get(name)) for name in options.checks)
    return Report(options.node, started, time.perf_counter() - t0, results)
