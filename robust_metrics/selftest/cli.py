"""`robust-metrics selftest`: stop-time checks that find the machine to blame before a restart.

    robust-metrics selftest [--quick] [--json] [--check compute --check memory ...]
        [--history FILE] [--fleet-median-flops F] [--expect-digest HEX] [--inject-fault SPEC]

Exit status: 0 when no check failed (passed or skipped), 1 when a check failed, 2 for bad
options. The sidecar runs it as a subprocess on `POST /control/selftest`; a Slurm prolog or a
Kubernetes init container runs it directly (`--quick`). docs/selftest.md says what each check
proves and what it cannot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from typing import TYPE_CHECKING

from robust_metrics.selftest.api import CHECKS, Report, faults

if TYPE_CHECKING:
    from robust_metrics.selftest.runner import SelftestOptions

__all__ = ["configure", "options_from_args", "run"]

EXIT_FAILED = 1
EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a fraction in (0, 1]")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `robust-metrics selftest`; defaults not shown are those of --quick or full."""
    parser.description = (
        "Run the node self-test: compute (seeded matmul, bit for bit across repeats and against "
        "a peer's digest, FLOP/s against history and the fleet), memory (pattern write and "
        "verify), communication (all-reduce bus bandwidth and per neighbour pair, naming the "
        "slow pair) and gpu (NVML: XID, ECC, row remaps, throttling). Exit 0: no check failed; "
        "1: a check failed; 2: bad options.")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes for a prolog or init container (<= 20 s on 2 CPU cores)")
    parser.add_argument("--check", action="append", choices=CHECKS, dest="checks",
                        help="run only this check (repeatable; default: all)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--node", default=os.environ.get("ROBUST_METRICS_NODE")
                        or socket.gethostname(), help="node name in the report")
    compute = parser.add_argument_group("compute")
    compute.add_argument("--size", type=_positive_int, help="matrix side (n x n float32)")
    compute.add_argument("--repeats", type=_positive_int, help="multiplies compared bit for bit")
    compute.add_argument("--seed", type=int, default=1234, help="seed of the inputs (default 1234)")
    compute.add_argument("--device", help="torch device (default: cuda when present, else cpu)")
    compute.add_argument("--history", help="JSON file of this node's past FLOP/s; read, then "
                         "extended when the check passes")
    compute.add_argument("--fleet-median-flops", type=_positive,
                         help="the fleet's median FLOP/s for the same size and hardware")
    compute.add_argument("--min-fraction", type=_fraction, default=0.5,
                         help="fail below this fraction of the history or fleet median (0.5)")
    compute.add_argument("--expect-digest", help="a peer's result digest for the same seed, size "
                         "and hardware; a different digest fails")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--memory-bytes", type=_positive_int, help="buffer written and verified")
    comm = parser.add_argument_group(
        "communication", "With MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set, this process is "
        "one rank of a multi-node group; otherwise --world-size ranks run on this machine.")
    comm.add_argument("--world-size", type=_positive_int, help="local ranks to spawn")
    comm.add_argument("--comm-bytes", type=_positive_int, help="all-reduce payload in bytes")
    comm.add_argument("--iterations", type=_positive_int, help="timed transfers per measurement")
    comm.add_argument("--min-bus-bandwidth", type=_positive,
                      help="fail below this all-reduce bus bandwidth (bytes per second)")
    comm.add_argument("--min-pair-fraction", type=_fraction, default=0.5,
                      help="a neighbour pair below this fraction of the best pair is slow (0.5)")
    comm.add_argument("--comm-timeout", type=_positive, help="seconds before the group gives up")
    comm.add_argument("--backend", choices=("gloo", "nccl"), help="torch.distributed backend")
    parser.add_argument("--inject-fault", metavar="SPEC",
                        help="tests only: e.g. compute, memory, gpu, communication:rank=1;delay=0.05 "
                        "(also ROBUST_SELFTEST_FAULT)")


def options_from_args(args: argparse.Namespace) -> SelftestOptions:
    """The runner's options: defaults of --quick or full, then the flags given."""
    from robust_metrics.selftest import communication, compute, gpu, memory, runner

    base = runner.default_options(args.quick)
    given = {
        "compute": {"size": args.size, "repeats": args.repeats, "seed": args.seed,
                    "device": args.device, "history": args.history,
                    "fleet_median_flops": args.fleet_median_flops,
                    "min_fraction": args.min_fraction, "expect_digest": args.expect_digest},
        "memory": {"size_bytes": args.memory_bytes},
        "communication": {"world_size": args.world_size, "size_bytes": args.comm_bytes,
                          "iterations": args.iterations, "min_bus_bandwidth": args.min_bus_bandwidth,
                          "min_pair_fraction": args.min_pair_fraction, "timeout_s": args.comm_timeout,
                          "backend": args.backend, "node": args.node},
    }
    merged = {name: {**base[name], **{k: v for k, v in given.get(name, {}).items()
                                      if v is not None}} for name in base}
    return runner.SelftestOptions(
        node=args.node, checks=tuple(dict.fromkeys(args.checks or CHECKS)),
        compute=compute.ComputeOptions(**merged["compute"]),
        memory=memory.MemoryOptions(**merged["memory"]),
        communication=communication.CommunicationOptions(**merged["communication"]),
        gpu=gpu.GpuOptions(**merged["gpu"]), inject_fault=args.inject_fault)


def _print(report: Report) -> None:
    for r in report.results:
        print(f"{r.check:<14} {r.verdict:<8} {r.duration_seconds:6.2f}s  {r.detail}")
    print(f"{'selftest':<14} {report.verdict:<8} {report.duration_seconds:6.2f}s  node "
          f"{report.node}" + (f"; failed: {', '.join(report.failed)}" if report.failed else ""))


def run(args: argparse.Namespace) -> int:
    from robust_metrics.selftest import communication, runner

    options = options_from_args(args)
    try:
        injected = faults(args.inject_fault)
        if "communication" in options.checks:
            communication.check_fault(injected.get("communication"), options.communication)
    except ValueError as exc:
        print(f"robust-metrics selftest: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = runner.run(options)
    if args.json:
        print(json.dumps(report.to_dict(), default=_jsonable))
    else:
        _print(report)
    return EXIT_FAILED if report.verdict == "fail" else 0


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)
