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


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def default_options(quick: bool = False) -> dict[str, dict[str, Any]]:
    """Per-check option defaults: `quick` keeps a prolog within seconds (docs/selftest.md)."""
    on_gpu = _cuda()
    local_world = max(2, min(4, os.cpu_count() or 2))
    if quick:
        return {"compute": {"size": 4096 if on_gpu else 384, "repeats": 3,
                            "device": "cuda" if on_gpu else "cpu"},
                "memory": {"size_bytes": 32 << 20},
                "communication": {"world_size": 2, "size_bytes": 1 << 20, "iterations": 3,
                                  "timeout_s": 30.0, "backend": "nccl" if on_gpu else "gloo"},
                "gpu": {"xid_wait_s": 0.1}}
    return {"compute": {"size": 8192 if on_gpu else 1024, "repeats": 5,
                        "device": "cuda" if on_gpu else "cpu"},
            "memory": {"size_bytes": 256 << 20},
            "communication": {"world_size": local_world, "size_bytes": 16 << 20,
                              "iterations": 5, "backend": "nccl" if on_gpu else "gloo"},
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
