"""GPU readiness check: the GPU-only paths of robust-metrics on a real GPU, in under 5 minutes.

    scripts/gpu-check            (or: .venv/bin/python scripts/gpu_check.py)

Runs each check in its own process with a time limit and prints a verdict table:

| check | what it proves |
|---|---|
| nvml | the sidecar's NVML collector agrees with `nvidia-smi` (memory, temperature, power) |
| events | CUDA-event step timing sees a deliberately slowed kernel (the host clock cannot) |
| nccl | a 1-rank NCCL group: durations come from the completion hook, counts match |
| nosync | `torch.cuda.set_sync_debug_mode("error")` over a hooked DDP loop: no added sync |

Exit status 0 when every check passes, 1 when one fails, 2 when there is no GPU (nothing ran).
Needs a CUDA build of torch and NCCL; 1 GPU is enough.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

CHECKS = ("nvml", "events", "nccl", "nosync")
LIMIT_SECONDS = 60  # per check; four checks stay under 5 minutes with start-up


@dataclass
class Verdict:
    check: str
    verdict: str  # PASS, FAIL, SKIP
    detail: str


def no_gpu_reason() -> str:
    """'' when a CUDA GPU is usable from torch, else why not."""
    try:
        import torch
    except Exception as exc:
        return f"no torch ({exc})"
    if not torch.cuda.is_available():
        build = "CPU-only torch build" if torch.version.cuda is None else "no CUDA device"
        return f"no GPU ({build})"
    return ""


# -- pure parts, tested without a GPU ------------------------------------------------------------
def parse_smi(text: str) -> dict[int, dict[str, float]]:
    """`nvidia-smi --query-gpu=index,memory.used,temperature.gpu,power.draw
    --format=csv,noheader,nounits` -> {index: {memory_bytes, celsius, watts}}."""
    out: dict[int, dict[str, float]] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        values = {}
        for key, raw, scale in (("memory_bytes", parts[1], 1024.0 * 1024.0),
                                ("celsius", parts[2], 1.0), ("watts", parts[3], 1.0)):
            try:
                values[key] = float(raw) * scale
            except ValueError:  # [N/A], [Not Supported]
                continue
        out[int(parts[0])] = values
    return out


def compare_nvml(scraped: dict[int, dict[str, float]], smi: dict[int, dict[str, float]],
                 ) -> Verdict:
    """Within tolerances that allow for the two reads being a moment apart."""
    if not smi:
        return Verdict("nvml", "FAIL", "nvidia-smi listed no GPU")
    tolerance = {"memory_bytes": (64 * 2**20, 0.05), "celsius": (3.0, 0.0), "watts": (30.0, 0.2)}
    problems, compared = [], 0
    for index, expected in sorted(smi.items()):
        got = scraped.get(index)
        if got is None:
            problems.append(f"gpu {index}: missing from the collector")
            continue
        for key, value in expected.items():
            if key not in got:
                continue
            absolute, relative = tolerance[key]
            compared += 1
            if abs(got[key] - value) > max(absolute, relative * abs(value)):
                problems.append(f"gpu {index} {key}: collector {got[key]:.0f}, smi {value:.0f}")
    if problems:
        return Verdict("nvml", "FAIL", "; ".join(problems))
    return Verdict("nvml", "PASS", f"{len(smi)} GPU(s), {compared} values agree with nvidia-smi")


def judge_events(event_step: float, slow: float, base: float, wall_step: float) -> Verdict:
    """The event-timed step must include the slow kernel and match the synchronised wall clock."""
    ok = abs(event_step - wall_step) <= 0.1 * wall_step and event_step >= base + 0.8 * slow
    detail = (f"event step {1e3 * event_step:.2f} ms, synchronised wall step "
              f"{1e3 * wall_step:.2f} ms, slow kernel {1e3 * slow:.2f} ms")
    return Verdict("events", "PASS" if ok else "FAIL", detail)


def table(verdicts: list[Verdict]) -> str:
    lines = ["| check | verdict | detail |", "|---|---|---|"]
    lines += [f"| {v.check} | {v.verdict} | {v.detail} |" for v in verdicts]
    return "\n".join(lines)


def exit_code(verdicts: list[Verdict]) -> int:
    if all(v.verdict == "SKIP" for v in verdicts):
        return 2
    return 1 if any(v.verdict == "FAIL" for v in verdicts) else 0


# -- the checks, each run in its own process ---------------------------------------------------
def check_nvml() -> Verdict:
    from robust_metrics.sidecar.collectors.nvml import NvmlCollector

    collector = NvmlCollector("gpu-check", xid_events=False)
    names = {"robust_gpu_memory_used_bytes": "memory_bytes",
             "robust_gpu_temperature_celsius": "celsius", "robust_gpu_power_watts": "watts"}
    scraped: dict[int, dict[str, float]] = {}
    try:
        for family in collector.collect():
            for sample in family.samples:
                if sample.name in names:
                    gpu = int(sample.labels["gpu"])
                    scraped.setdefault(gpu, {})[names[sample.name]] = sample.value
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,temperature.gpu,"
                              "power.draw", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    finally:
        collector.close()
    return compare_nvml(scraped, parse_smi(smi))


def _slow_kernel_seconds(torch: Any, cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()  # calibration, before the hook is on
    return float(start.elapsed_time(end)) / 1000.0


def check_events() -> Verdict:
    import torch

    import robust_metrics

    cycles = 20_000_000
    slow = _slow_kernel_seconds(torch, cycles)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 1)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512, device="cuda")

    def step(slowed: bool) -> None:
        loss = model(x).pow(2).mean()
        if slowed:
            torch.cuda._sleep(cycles)  # deliberately slowed: device time the host never sees
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(5):
        step(False)
    torch.cuda.synchronize()
    base_start = time.perf_counter()
    for _ in range(20):
        step(False)
    torch.cuda.synchronize()
    base = (time.perf_counter() - base_start) / 20
    steps = 30
    with robust_metrics.watch(model, optimizer, backend="null", run="gpu-check") as handle:
        summary = handle._step_duration
        step(True)
        step(True)
        torch.cuda.synchronize()
        step(True)  # reads the events of the steps before; the first was timed by the host
        count0, sum0 = summary.count, summary.sum
        began = time.perf_counter()
        for _ in range(steps):
            step(True)
        torch.cuda.synchronize()
        wall_step = (time.perf_counter() - began) / steps
        count, total = summary.count - count0, summary.sum - sum0
    event_step = total / count if count else 0.0
    return judge_events(event_step, slow, base, wall_step)


def check_nccl() -> Verdict:
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29599")
    import torch
    import torch.distributed as dist

    import robust_metrics

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        x = torch.ones(32 * 2**20, device="cuda")  # 128 MiB: a measurable duration
        model = torch.nn.Linear(4, 4).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with robust_metrics.watch(model, optimizer, backend="null", run="gpu-check") as handle:
            for _ in range(10):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the hook runs on NCCL's watchdog thread
                stats, entered, completed = handle.tracker.snapshot()
                if completed.get("default_pg", 0) >= 10:
                    break
                time.sleep(0.1)
        stat = stats.get(("all_reduce", "default_pg"))
        seconds = stat.seconds / stat.count if stat and stat.count else 0.0
        ok = (entered.get("default_pg") == 10 and completed.get("default_pg") == 10
              and seconds > 0)
        return Verdict("nccl", "PASS" if ok else "FAIL",
                       f"entered {entered.get('default_pg')}, completed "
                       f"{completed.get('default_pg')}, mean duration {1e6 * seconds:.0f} µs "
                       "from the completion hook")
    finally:
        dist.destroy_process_group()


def check_nosync() -> Verdict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29598")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import robust_metrics

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 1)).cuda())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(32, 64, device="cuda")
        with robust_metrics.watch(model, optimizer, backend="null", run="gpu-check") as handle:
            for _ in range(3):  # warm-up outside the check: DDP's first steps may synchronise
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(20):
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            errors = {s.series.labels: s.value for s in handle.store.samples()
                      if s.name == "robust_hook_errors_total" and s.value}
        steps = handle._step_duration.count
        ok = not errors and steps >= 18
        return Verdict("nosync", "PASS" if ok else "FAIL",
                       f"20 hooked DDP steps under sync debug mode 'error'; {steps:.0f} steps "
                       f"timed from events; hook errors {errors or 'none'}")
    finally:
        dist.destroy_process_group()


RUNNERS: dict[str, Callable[[], Verdict]] = {
    "nvml": check_nvml, "events": check_events, "nccl": check_nccl, "nosync": check_nosync}


def run_one(name: str) -> Verdict:
    """One check in a child process, so a hang or a crash costs that check only."""
    try:
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                              text=True, timeout=LIMIT_SECONDS)
    except subprocess.TimeoutExpired:
        return Verdict(name, "FAIL", f"no answer within {LIMIT_SECONDS} s")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return Verdict(**json.loads(line))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return Verdict(name, "FAIL", f"exit {done.returncode}: {tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=CHECKS, help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", choices=CHECKS, default=list(CHECKS))
    args = parser.parse_args(argv)
    if args.one:
        try:
            verdict = RUNNERS[args.one]()
        except Exception as exc:
            verdict = Verdict(args.one, "FAIL", f"{type(exc).__name__}: {exc}")
        print(json.dumps(asdict(verdict)), flush=True)
        return 0
    missing = no_gpu_reason()
    if missing:
        verdicts = [Verdict(name, "SKIP", missing) for name in args.only]
    else:
        verdicts = [run_one(name) for name in args.only]
    print(table(verdicts))
    code = exit_code(verdicts)
    if code == 2:
        print(f"gpu-check: {missing}: nothing was checked", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
