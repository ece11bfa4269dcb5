"""`compute`: a seeded float32 matrix multiply, repeated; silent data corruption and slow silicon.

Why: a GPU or CPU that computes wrong numbers without an error (silent data corruption) poisons
training with NaNs or drift that looks like a model bug, and a restart onto it replays the fault.
The same seeded inputs multiplied several times must give the same bytes every time (same
kernel, same shape, same device); the SHA-256 digest of the result is reported so it can be
compared with a peer node's digest for the same seed, size and hardware (`expect_digest`).
Throughput (FLOP/s, 2·n³ per multiply) is compared with this node's own history (a small JSON
file) and with a fleet median given by the caller: a node far below either is slow silicon
(throttling, a bad DIMM channel, a neighbour hogging the socket).

Fault injection (`compute` fault): one element of the second repeat's result gets its lowest bit
flipped, as a corrupting ALU would; `compute:slow=SECONDS` adds that many seconds to each timed
multiply.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from robust_metrics.selftest.api import CheckResult

__all__ = ["ComputeOptions", "run"]

log = logging.getLogger(__name__)
HISTORY_KEEP = 20  # figures kept per node in the history file


@dataclass(frozen=True)
class ComputeOptions:
    """Shape and thresholds of the compute check."""

    size: int = 1024
    repeats: int = 5
    seed: int = 1234
    device: str = "cpu"
    history: str | None = None  # JSON history file of this node's FLOP/s
    fleet_median_flops: float | None = None
    min_fraction: float = 0.5
    expect_digest: str | None = None


def _multiply(options: ComputeOptions, fault: Mapping[str, str] | None) -> tuple[list[str], float]:
    """The digest of each repeat's result and the best seconds per multiply."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(options.seed)
    a = torch.randn(options.size, options.size, generator=generator, dtype=torch.float32)
    b = torch.randn(options.size, options.size, generator=generator, dtype=torch.float32)
    a, b = a.to(options.device), b.to(options.device)
    slow = float((fault or {}).get("slow", 0) or 0)
    digests, best = [], float("inf")
    for repeat in range(options.repeats):
        _sync(options.device)
        started = time.perf_counter()
        c = a @ b
        _sync(options.device)
        if slow:
            time.sleep(slow)
        best = min(best, time.perf_counter() - started)
        host = c.cpu().contiguous()
        if fault is not None and not slow and repeat == 1:
            host.view(torch.int32).view(-1)[0] ^= 1  # one flipped bit, as a bad ALU would
        digests.append(hashlib.sha256(host.numpy().tobytes()).hexdigest())
    return digests, best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _history(path: str | None) -> list[float]:
    """This node's earlier FLOP/s figures; an unreadable file counts as no history."""
    if not path or not os.path.exists(path):
        return []
    try:
        figures = json.loads(Path(path).read_text()).get("compute_flops", [])
        return [float(x) for x in figures if isinstance(x, int | float) and x > 0]
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("compute history %s unreadable, ignored: %s", path, exc)
        return []


def _remember(path: str | None, figures: list[float], flops: float) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps({"compute_flops": [*figures, flops][-HISTORY_KEEP:]}))
    os.replace(tmp, path)


def _slow(flops: float, options: ComputeOptions, past: list[float]) -> list[str]:
    """Why the throughput fails, one reason per reference it falls short of."""
    reasons = []
    references = {"this node's median": statistics.median(past) if past else None,
                  "the fleet median": options.fleet_median_flops}
    for name, reference in references.items():
        if reference and flops < options.min_fraction * reference:
            reasons.append(f"{flops / 1e9:.1f} GFLOP/s is below {options.min_fraction:g} x "
                           f"{name} ({reference / 1e9:.1f} GFLOP/s)")
    return reasons


def run(options: ComputeOptions, fault: Mapping[str, str] | None = None) -> CheckResult:
    """Multiply, compare the repeats bit for bit and against a peer, and judge throughput."""
    digests, seconds = _multiply(options, fault)
    flops = 2.0 * options.size ** 3 / seconds
    past = _history(options.history)
    problems = []
    if len(set(digests)) > 1:
        problems.append(f"results differ across {options.repeats} repeats of the same multiply "
                        f"({len(set(digests))} distinct digests): silent data corruption")
    elif options.expect_digest and digests[0] != options.expect_digest:
        problems.append(f"digest {digests[0][:16]}... differs from the peer's "
                        f"{options.expect_digest[:16]}... for seed {options.seed}, size "
                        f"{options.size}")
    problems += _slow(flops, options, past)
    if not problems:
        _remember(options.history, past, flops)  # a failing figure never becomes the baseline
    data: dict[str, Any] = {"digest": digests[0], "digests": digests, "seed": options.seed,
                            "size": options.size, "repeats": options.repeats,
                            "device": options.device, "history_median_flops":
                            statistics.median(past) if past else None,
                            "fleet_median_flops": options.fleet_median_flops}
    detail = "; ".join(problems) or (f"{options.repeats} repeats identical, "
                                     f"{flops / 1e9:.1f} GFLOP/s, digest {digests[0][:16]}")
    return CheckResult("compute", "fail" if problems else "pass", flops, "flops", detail,
                       data=data)
