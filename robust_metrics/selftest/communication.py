"""`communication`: all-reduce bus bandwidth of a group, and the bandwidth of each neighbour pair.

Why: one slow NIC, cable or switch port makes every collective of a job wait for it, and the
job's own metrics show its peers waiting, not the link. Two measurements:

- **bus bandwidth** of an all-reduce of `size_bytes` (as nccl-tests reports it: algorithm
  bandwidth times 2(n-1)/n, so the figure is comparable across group sizes), the slowest rank's
  time deciding, against an optional floor `min_bus_bandwidth` (bytes per second);
- **pair bandwidth** of each ring neighbour pair (rank i and i+1) by a ping-pong of the same
  buffer, pair by pair while the others wait, the best of `iterations` exchanges counting; a pair
  below `min_pair_fraction` of the best pair is slow, and a rank in every slow pair (with at
  least two of them) is named as the culprit.

Where the group comes from: with `MASTER_ADDR`, `WORLD_SIZE` and `RANK` in the environment (as
torchrun, a Slurm prolog or an init container sets them, one process per node) this process is
one rank of a multi-node group; otherwise `world_size` ranks are spawned on this machine over
loopback, which tests the host's own stack only. Gloo on CPUs; `backend="nccl"` on GPUs.

Fault injection (`communication:rank=R;delay=SECONDS`): rank R sleeps `delay` (default 0.05 s)
before each transfer it takes part in, as a throttled link would.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from robust_metrics.numbers import decimal
from robust_metrics.selftest.api import CheckResult

__all__ = ["CommunicationOptions", "measure", "run"]

log = logging.getLogger(__name__)
ENV_KEYS = ("MASTER_ADDR", "WORLD_SIZE", "RANK")


@dataclass(frozen=True)
class CommunicationOptions:
    """Group, payload and thresholds of the communication check."""

    world_size: int = 2
    size_bytes: int = 16 << 20
    iterations: int = 5
    min_bus_bandwidth: float | None = None
    min_pair_fraction: float = 0.5
    timeout_s: float = 60.0
    backend: str = "gloo"
    node: str = ""


def _delay(fault: Mapping[str, str] | None, rank: int) -> float:
    if fault is None or str(rank) != fault.get("rank", "0"):
        return 0.0
    return float(fault.get("delay", 0.05))


def _timed_allreduce(tensor: Any, iterations: int, delay: float) -> float:
    """Seconds per all-reduce on this rank (after one warm-up)."""
    import torch.distributed as dist

    dist.all_reduce(tensor)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        if delay:
            time.sleep(delay)
        dist.all_reduce(tensor)
    return (time.perf_counter() - started) / iterations


def _pairs(world: int) -> list[tuple[int, int]]:
    """Ring neighbour pairs, each once: (0,1), (1,2), ..., (n-1,0)."""
    return sorted({tuple(sorted((i, (i + 1) % world))) for i in range(world)})  # type: ignore[misc]


def _ping_pong(tensor: Any, rank: int, first: int, peer: int) -> None:
    import torch.distributed as dist

    if rank == first:
        dist.send(tensor, peer)
        dist.recv(tensor, peer)
    else:
        dist.recv(tensor, peer)
        dist.send(tensor, peer)


def _timed_pair(tensor: Any, pair: tuple[int, int], rank: int, iterations: int,
                delay: float) -> float:
    """Best seconds of a ping-pong of `pair` (after one warm-up), measured on its first rank
    (0.0 on the others). The best, not the mean: a throttled link is slow every time, while a
    busy host only delays some exchanges."""
    import torch.distributed as dist

    first, second = pair
    dist.barrier()
    if rank not in pair:
        return 0.0
    peer = second if rank == first else first
    _ping_pong(tensor, rank, first, peer)
    best = float("inf")
    for _ in range(iterations):
        started = time.perf_counter()
        if delay:
            time.sleep(delay)
        _ping_pong(tensor, rank, first, peer)
        best = min(best, time.perf_counter() - started)
    return best if rank == first else 0.0


def measure(rank: int, world: int, options: CommunicationOptions,
            fault: Mapping[str, str] | None) -> dict[str, Any]:
    """This rank's part of the check, in an initialised process group; the same dict on every
    rank: bus bandwidth, each pair's bandwidth and every rank's node name."""
    import torch
    import torch.distributed as dist

    delay = _delay(fault, rank)
    tensor = torch.ones(max(1, options.size_bytes // 4), dtype=torch.float32)
    if options.backend == "nccl":
        tensor = tensor.cuda()
    size = tensor.numel() * 4
    seconds = torch.tensor([_timed_allreduce(tensor, options.iterations, delay)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    pairs = _pairs(world) if world > 1 else []
    times = torch.tensor([_timed_pair(tensor, p, rank, options.iterations, delay) for p in pairs])
    if pairs:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, options.node or socket.gethostname())
    algbw = size / float(seconds)
    return {"world_size": world, "size_bytes": size, "nodes": nodes,
            "bus_bandwidth": algbw * 2 * (world - 1) / world if world > 1 else algbw,
            "pairs": [{"ranks": list(p), "bandwidth": 2 * size / float(t)}
                      for p, t in zip(pairs, times.tolist(), strict=True)]}


def _worker(rank: int, world: int, port: int, options: CommunicationOptions,
            fault: Mapping[str, str] | None, out: Any) -> None:
    """One spawned local rank: join the group through the parent's store and measure."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if options.backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per local rank
    timeout = datetime.timedelta(seconds=options.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timeout)
    dist.init_process_group(options.backend, store=store, rank=rank, world_size=world,
                            timeout=timeout)
    try:
        result = measure(rank, world, options, fault)
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def _spawn(options: CommunicationOptions, fault: Mapping[str, str] | None) -> dict[str, Any]:
    """Run `world_size` local ranks; their measurement, or TimeoutError/RuntimeError."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    timeout = datetime.timedelta(seconds=options.timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, options.world_size + 1, is_master=True,
                          timeout=timeout, wait_for_workers=False)
    out = context.Queue()
    procs = [context.Process(target=_worker, daemon=True, name=f"selftest-comm-{r}",
                             args=(r, options.world_size, store.port, options, fault, out))
             for r in range(options.world_size)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=options.timeout_s)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        raise TimeoutError(f"no result from {options.world_size} local ranks within "
                           f"{options.timeout_s:g} s (exit codes {codes})") from None
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store


def _in_env_group(options: CommunicationOptions,
                  fault: Mapping[str, str] | None) -> tuple[dict[str, Any], int]:
    """Join the multi-node group the environment describes, as its RANK."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if options.backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(options.backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=options.timeout_s))
    try:
        return measure(rank, world, options, fault), rank
    finally:
        dist.destroy_process_group()


def judge(result: Mapping[str, Any], options: CommunicationOptions,
          own_rank: int | None) -> tuple[list[str], list[int]]:
    """Problems found and the ranks to blame. With `own_rank` (one rank per node) only the
    problems of that rank, or of the whole group, are this node's: a slow pair is its culprit's
    when a rank is in every slow pair, else both its ends'."""
    problems, culprits = [], []
    bus = float(result["bus_bandwidth"])
    if options.min_bus_bandwidth and bus < options.min_bus_bandwidth:
        problems.append(f"bus bandwidth {bus / 1e9:.3f} GB/s is below the floor "
                        f"{options.min_bus_bandwidth / 1e9:.3f} GB/s")
    pairs = list(result["pairs"])
    best = max((p["bandwidth"] for p in pairs), default=0.0)
    slow = [p for p in pairs if p["bandwidth"] < options.min_pair_fraction * best]
    if len(slow) >= 2:
        common = set.intersection(*(set(p["ranks"]) for p in slow))
        culprits = sorted(common) if len(common) == 1 else []
    nodes = result["nodes"]
    for p in slow:
        # a named culprit answers for its pairs; without one, each end of a slow pair does
        blamed = set(p["ranks"]) & set(culprits) if culprits else set(p["ranks"])
        if own_rank is not None and own_rank not in blamed:
            continue
        a, b = p["ranks"]
        problems.append(f"pair rank {a} ({nodes[a]}) - rank {b} ({nodes[b]}): "
                        f"{p['bandwidth'] / 1e9:.3f} GB/s, below {options.min_pair_fraction:g} "
                        f"x the best pair ({best / 1e9:.3f} GB/s)")
    if culprits and (own_rank is None or own_rank in culprits):
        problems.insert(0, f"rank {culprits[0]} ({nodes[culprits[0]]}) is in every slow pair")
    return problems, culprits


def check_fault(fault: Mapping[str, str] | None, options: CommunicationOptions) -> None:
    """ValueError when the fault names a rank the group will not have: no rank would slow its
    link and the check would pass, as if the fault had been caught nowhere."""
    if not fault or "rank" not in fault:
        return
    in_env = all(os.environ.get(k) for k in ENV_KEYS)
    world = decimal(os.environ.get("WORLD_SIZE", "")) if in_env else options.world_size
    if world is not None and int(fault["rank"]) >= world:
        raise ValueError(f"fault communication:rank={fault['rank']}: no such rank in a group of "
                         f"{world} (ranks 0-{world - 1})")


def run(options: CommunicationOptions, fault: Mapping[str, str] | None = None) -> CheckResult:
    """Measure in the environment's group or among spawned local ranks, then judge."""
    own_rank = None
    try:
        if all(os.environ.get(k) for k in ENV_KEYS):
            result, own_rank = _in_env_group(options, fault)
        elif options.world_size < 2:
            return CheckResult("communication", "skipped", None, "bytes_per_second",
                               "a group of one has no link to test (world size 1)")
        else:
            result = _spawn(options, fault)
    except (TimeoutError, RuntimeError, OSError) as exc:
        return CheckResult("communication", "fail", None, "bytes_per_second",
                           f"the group did not complete: {exc}", data={"options": asdict(options)})
    problems, culprits = judge(result, options, own_rank)
    bus = float(result["bus_bandwidth"])
    median = statistics.median(p["bandwidth"] for p in result["pairs"]) if result["pairs"] else 0
    detail = "; ".join(problems) or (
        f"bus bandwidth {bus / 1e9:.3f} GB/s over {result['world_size']} ranks, "
        f"{len(result['pairs'])} pair(s), median {median / 1e9:.3f} GB/s")
    return CheckResult("communication", "fail" if problems else "pass", bus, "bytes_per_second",
                       detail, data={**result, "culprit_ranks": culprits, "rank": own_rank})
