"""GPU readiness check: the GPU-only paths of robust-metrics on a real GPU, in under 5 minutes.

    scripts/gpu-check            (or: .venv/bin/python scripts/gpu_check.py)

Runs each check in its own process with a time limit and prints a verdict table:

| check | what it proves |
|---|---|
| nvml | the sidecar's NVML collector agrees with `nvidia-smi` (memory, temperature, power) |
| events | CUDA-event step timing sees a deliberately slowed kernel (the host clock cannot) |
| nccl | a 1-rank NCCL group: durations come from the completion hook, counts match |
| nosync | `torch.cuda.set_sync_debug_mode("error")` over a hooked DDP loop: no added sync |
| streams | FSDP2's stream pattern on 1 GPU: the step's wait for a late side-stream all-gather is blocked |
| fsdp2 | 2 NCCL ranks of `parallel_job --stack fsdp2 --device cuda`, rank 1 1.3x slower: named |
| pp | the same with a 2-stage GPipe pipeline (P2P works waited on the compute stream) |
| selftest | `selftest --quick`: compute on the GPU, bit-identical across repeats; NVML health passes |

On request (`--only cost`, not in the default run, which stays within 5 minutes):

| check | what it measures |
|---|---|
| cost | the hook's CPU and wall time per step of a 1-rank NCCL DDP loop against the same loop |
| | unwatched, without and with `TORCH_NCCL_ENABLE_TIMING=1` (one process each) |

Exit status 0 when every check passes, 1 when one fails, 2 when there is no GPU (nothing ran).
Needs a CUDA build of torch and NCCL; 1 GPU runs every check but `fsdp2` and `pp`, which need 2
(one NCCL rank per GPU) and are SKIP with fewer. At most about 5 minutes in all (the limits below).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CHECKS = ("nvml", "events", "nccl", "nosync", "streams", "fsdp2", "pp", "selftest")
ON_REQUEST = ("cost",)  # run with --only: beyond the default run's 5 minutes
COST_LIMIT = 60  # seconds for the cost check: two processes of ~15 s each, start-up included
# seconds per check, start-up included: 295 s in all
LIMITS = {"nvml": 20, "events": 35, "nccl": 35, "nosync": 40, "streams": 40, "fsdp2": 50, "pp": 50,
          "selftest": 25}


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


def judge_streams(blocked: float, late: float, overlap: float) -> Verdict:
    """The step's stream waits `late - overlap` for the side stream's all-gather: that, within
    25%, is blocked (marks on the side stream alone would give about 0)."""
    expected = late - overlap
    ok = abs(blocked - expected) <= 0.25 * expected
    detail = (f"blocked {1e3 * blocked:.2f} ms per step, the compute stream's wait "
              f"{1e3 * expected:.2f} ms (side stream held {1e3 * late:.2f} ms, "
              f"{1e3 * overlap:.2f} ms of it overlapped by compute)")
    return Verdict("streams", "PASS" if ok else "FAIL", detail)


def judge_straggler(check: str, computes: list[float], slow: int, errors: float, steps: list[float],
                    expected_steps: int) -> Verdict:
    """The slowed rank's mean compute >= 1.2x the median of the others', no other above 1.1x,
    every step counted, no hook error."""
    if not computes or min(computes) <= 0:
        return Verdict(check, "FAIL", f"no compute time published: {computes}")
    ratios = [c / statistics.median(computes[:r] + computes[r + 1:])
              for r, c in enumerate(computes)]
    named = ratios[slow] >= 1.2 and all(x <= 1.1 for r, x in enumerate(ratios) if r != slow)
    ok = named and not errors and all(s == expected_steps for s in steps)
    detail = (f"compute ratios {', '.join(f'{x:.2f}' for x in ratios)} (rank {slow} slowed "
              f"1.3x), steps {steps}, hook errors {errors:.0f}")
    return Verdict(check, "PASS" if ok else "FAIL", detail)


def judge_cost(plain: dict[str, float], timed: dict[str, float]) -> Verdict:
    """The hook's added CPU per step (median of paired rounds) on a GPU DDP step, without
    `TORCH_NCCL_ENABLE_TIMING` (the default, which must stay cheap: at most 100 µs and 5% of
    the step) and with it, whose own cost is the unwatched step's difference between the two."""
    added = plain["hook_cpu_us"]
    ok = added <= min(100.0, 0.05 * plain["base_wall_us"])
    detail = (f"hook adds {added:.0f} µs CPU, {plain['hook_wall_us']:+.0f} µs wall per "
              f"{plain['base_wall_us'] / 1e3:.2f} ms step without TORCH_NCCL_ENABLE_TIMING; "
              f"{timed['hook_cpu_us']:.0f} µs CPU, {timed['hook_wall_us']:+.0f} µs wall with it; "
              f"the unwatched step with it {timed['base_wall_us'] / 1e3:.2f} ms")
    return Verdict("cost", "PASS" if ok else "FAIL", detail)


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


def check_streams() -> Verdict:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29597")
    import torch
    import torch.distributed as dist

    import robust_metrics

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cycles_per_second = 20_000_000 / _slow_kernel_seconds(torch, 20_000_000)
        late, overlap = 0.020, 0.005
        model = torch.nn.Linear(64, 64).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, shard = torch.randn(32, 64, device="cuda"), torch.ones(2**20, device="cuda")
        gathered = torch.empty_like(shard)  # one rank: the gathered tensor is the shard
        side = torch.cuda.Stream()

        def step() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # as FSDP2's foreach_all_gather
                torch.cuda._sleep(int(late * cycles_per_second))  # a peer that comes late
                dist.all_gather_single(gathered, shard)
                event = side.record_event()
            torch.cuda._sleep(int(overlap * cycles_per_second))  # compute meanwhile
            torch.cuda.current_stream().wait_event(event)  # foreach_all_gather_copy_out
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        with robust_metrics.watch(model, optimizer, backend="null", run="gpu-check") as handle:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            step()  # reads the steps before
            duration, compute = handle._step_duration, handle._step_compute
            count0, blocked0 = duration.count, duration.sum - compute.sum
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            step()
            count = duration.count - count0
            blocked = (duration.sum - compute.sum - blocked0) / count if count else 0.0
        return judge_streams(blocked, late, overlap)
    finally:
        dist.destroy_process_group()


def _straggler_job(check: str, args: list[str]) -> Verdict:
    """Two NCCL ranks of the parallel job, rank 1 slowed 1.3x in forward; its metrics read back
    with prometheus_client's MultiProcessCollector."""
    import torch

    if torch.cuda.device_count() < 2:
        return Verdict(check, "SKIP", f"needs 2 GPUs (one NCCL rank each), found "
                                      f"{torch.cuda.device_count()}")
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from robust_metrics import workloads
    from robust_metrics.processes import RankJob

    steps = 20
    script = os.path.join(os.path.dirname(workloads.__file__), "parallel_job.py")
    with tempfile.TemporaryDirectory() as tmp:
        metrics, logs = os.path.join(tmp, "metrics"), os.path.join(tmp, "logs")
        os.makedirs(metrics)
        os.makedirs(logs)
        with RankJob(2, [*args, "--device", "cuda", "--steps", str(steps), "--compute", "0.1",
                         "--slow-rank", "1", "--slow-factor", "1.3"], script=Path(script),
                     log_dir=Path(logs), run="gpu-check",
                     env={"ROBUST_METRICS_DIR": metrics, "TORCH_NCCL_ENABLE_TIMING": "1"}) as job:
            codes = job.wait(timeout=LIMITS[check] - 10)
            if codes != [0, 0]:
                tail = job.logs().strip().splitlines()[-1:] or ["no output"]
                return Verdict(check, "FAIL", f"exit codes {codes}: {tail[0]}")
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=metrics)
        values: dict[tuple[str, str], float] = {}
        for family in registry.collect():
            for sample in family.samples:
                key = (sample.name, sample.labels.get("rank", ""))
                values[key] = values.get(key, 0.0) + sample.value
    computes = [values.get(("robust_step_compute_seconds_sum", str(r)), 0.0)
                / max(values.get(("robust_step_compute_seconds_count", str(r)), 0.0), 1.0)
                for r in range(2)]
    errors = sum(values.get(("robust_hook_errors_total", str(r)), 0.0) for r in range(2))
    counted = [values.get(("robust_steps_total", str(r)), 0.0) for r in range(2)]
    return judge_straggler(check, computes, 1, errors, counted, steps)


def check_fsdp2() -> Verdict:
    return _straggler_job("fsdp2", ["--stack", "fsdp2"])


def check_pp() -> Verdict:
    return _straggler_job("pp", ["--stack", "pp", "--schedule", "gpipe"])


def judge_selftest(report: dict[str, Any]) -> Verdict:
    """PASS when no check failed, the compute check ran on a GPU and NVML's health check passed
    (a check that runs on the CPU or is skipped proves nothing about the GPU path)."""
    results = {r["check"]: r for r in report.get("results", [])}
    compute, gpu = results.get("compute", {}), results.get("gpu", {})
    figures = "; ".join(f"{name} {r['verdict']}: {r['detail']}" for name, r in results.items())
    if report.get("verdict") == "fail":
        return Verdict("selftest", "FAIL", figures)
    device = compute.get("data", {}).get("device", "")
    if compute.get("verdict") != "pass" or not str(device).startswith("cuda"):
        return Verdict("selftest", "FAIL", f"the compute check did not pass on a GPU: {figures}")
    if gpu.get("verdict") != "pass":
        return Verdict("selftest", "FAIL", f"the NVML health check did not pass: {figures}")
    return Verdict("selftest", "PASS", figures)


def check_selftest() -> Verdict:
    done = subprocess.run([sys.executable, "-m", "robust_metrics", "selftest", "--quick", "--json"],
                          capture_output=True, text=True, timeout=LIMITS["selftest"] - 2)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Verdict("selftest", "FAIL", f"exit {done.returncode}: {tail}")
    return judge_selftest(json.loads(lines[-1]))


def cost_rounds(timing: bool, rounds: int = 9, steps: int = 30) -> dict[str, float]:
    """One process of the cost check: a 1-rank NCCL DDP loop, watched and unwatched (two copies
    of one model, the watch open throughout: NCCL's completion hook cannot be registered twice
    on a group), in interleaved rounds; medians of paired rounds, in µs per step."""
    if timing:
        os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"  # read when the process group is made
    else:
        os.environ.pop("TORCH_NCCL_ENABLE_TIMING", None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29596" if timing else "29595")
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import robust_metrics

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
        loops = {}
        for name in ("base", "hook"):
            model = DDP(copy.deepcopy(net))
            loops[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-4))
        x = torch.randn(256, 1024, device="cuda")

        def run(name: str, count: int) -> tuple[float, float]:
            model, optimizer = loops[name]
            torch.cuda.synchronize()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(count):
                model(x).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            return (time.process_time() - cpu) / count, (time.perf_counter() - wall) / count

        hook_model, hook_optimizer = loops["hook"]
        with robust_metrics.watch(hook_model, hook_optimizer, backend="null", run="gpu-check"):
            run("base", 10)
            run("hook", 10)
            times: dict[str, list[tuple[float, float]]] = {"base": [], "hook": []}
            for r in range(rounds):
                for name in (("base", "hook") if r % 2 else ("hook", "base")):
                    times[name].append(run(name, steps))
        paired = list(zip(times["hook"], times["base"], strict=True))
        return {"hook_cpu_us": 1e6 * statistics.median(h[0] - b[0] for h, b in paired),
                "hook_wall_us": 1e6 * statistics.median(h[1] - b[1] for h, b in paired),
                "base_wall_us": 1e6 * statistics.median(b[1] for b in times["base"])}
    finally:
        dist.destroy_process_group()


def check_cost() -> Verdict:
    results = []
    for timing in ("0", "1"):
        done = subprocess.run([sys.executable, __file__, "--cost-rounds", timing],
                              capture_output=True, text=True, timeout=COST_LIMIT / 2 - 2)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return Verdict("cost", "FAIL", f"TORCH_NCCL_ENABLE_TIMING={timing}: exit "
                                           f"{done.returncode}: {tail}")
        results.append(json.loads(lines[-1]))
    return judge_cost(*results)


RUNNERS: dict[str, Callable[[], Verdict]] = {
    "nvml": check_nvml, "events": check_events, "nccl": check_nccl, "nosync": check_nosync,
    "streams": check_streams, "fsdp2": check_fsdp2, "pp": check_pp, "selftest": check_selftest,
    "cost": check_cost}


def run_one(name: str) -> Verdict:
    """One check in a child process, so a hang or a crash costs that check only."""
    try:
        limit = LIMITS.get(name, COST_LIMIT)
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                              text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return Verdict(name, "FAIL", f"no answer within {limit} s")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return Verdict(**json.loads(line))
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return Verdict(name, "FAIL", f"exit {done.returncode}: {tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=CHECKS + ON_REQUEST, help=argparse.SUPPRESS)
    parser.add_argument("--cost-rounds", choices=("0", "1"), help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", choices=CHECKS + ON_REQUEST, default=list(CHECKS))
    args = parser.parse_args(argv)
    if args.cost_rounds:
        print(json.dumps(cost_rounds(args.cost_rounds == "1")), flush=True)
        return 0
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
