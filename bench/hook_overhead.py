"""Hook overhead: CPU time the hook adds per training step, against the same loop without it and
against a peer, nvidia-resiliency-ext's straggler sections, in the same run.

A 2-layer 256-wide MLP on gloo, `--stack`:
- `ddp` (default): under DDP on a 1-rank group (DDP's reducer and all-reduce are on the path),
  ~1.2 ms steps;
- `fsdp2`: `fully_shard` on each layer and the root, on two ranks (two processes; on one rank
  FSDP2 issues no collective at all), every all-gather and reduce-scatter through the hook's
  wrappers;
- `pp`: two ranks (two processes), one pipeline stage of one layer each under GPipe with 4
  micro-batches (every send and receive, and its `Work.wait`, goes through the wrappers).
On two ranks both run the same variants in the same order, and rank 0 reports its training
thread's CPU time (gloo's threads spin while a rank waits for its peer).

One model trains under every variant in turn, `--steps` steps each,
the variants in a rotated order per round (interleaved rounds, so drift on a shared machine hits
all alike):

- baseline: the loop alone;
- hook defaults (`robust_metrics.watch`, compute/blocked split on), and `collectives=False`;
- peer: `nvidia_resiliency_ext.straggler.Detector.detection_section` around forward, backward
  and the optimizer step (`profile_cuda=False`: there is no GPU here). It needs libcupti at import
  time (`pip install nvidia-resiliency-ext nvidia-cuda-cupti-cu12`); where it cannot be imported
  the peer row is "CPU sections": the same three sections timed with `time.perf_counter`, which
  is what the peer does on the CPU;
- CPU sections, always, as a floor for any sectioned timer.

Figures are process CPU seconds per step (every thread: gloo's and the hook's flusher), and wall
seconds beside them: per variant, the median over rounds of (variant - baseline of the same
round), and the difference of the fastest rounds. Wall time on a shared machine moves by more
than the hook costs; the CPU minimum is the steadiest figure. Two machine-independent counts
follow, from one untimed pass under `sys.setprofile`: the Python calls (frames) each variant adds
per step, and the hook's collective wrappers entered per step (`Work.wait` included), by which
the added CPU of the collective timing (defaults minus `collectives=False`) is divided for its
cost per wrapped call. Run:

    .venv/bin/python bench/hook_overhead.py [--stack ddp|fsdp2|pp] [--steps 100] [--rounds 25]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import robust_metrics

Section = Callable[[str], contextlib.AbstractContextManager[Any]]


class Stack:
    """The model of one `--stack`, what `watch()` is given, and one training step."""

    def __init__(self, kind: str) -> None:
        torch.manual_seed(0)
        self.kind, self.schedule, self.first, self.last = kind, None, True, True
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 256))
        if kind == "ddp":
            self.model = self.watched = DDP(net)
        elif kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in (net[0], net[2]):
                fully_shard(layer)
            self.model = self.watched = fully_shard(net)
        else:
            self._pipeline()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def _pipeline(self) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
        self.watched = PipelineStage(self.model, rank, world, torch.device("cpu"))
        self.schedule = ScheduleGPipe(self.watched, 4, loss_fn=lambda out, y: out.pow(2).mean())
        self.first, self.last = rank == 0, rank == world - 1

    def forward_backward(self, x: torch.Tensor, section: Section) -> None:
        if self.schedule is None:
            with section("forward"):
                loss = self.model(x).pow(2).mean()
            with section("backward"):
                loss.backward()
            return
        with section("forward"):  # the schedule runs forward and backward together
            if self.first:
                self.schedule.step(x, target=x if self.last else None)
            elif self.last:
                self.schedule.step(target=x)
            else:
                self.schedule.step()


def make(kind: str = "ddp") -> Stack:
    return Stack(kind)


@contextlib.contextmanager
def _no_section(name: str) -> Iterator[None]:
    yield


class CpuSections:
    """Forward/backward/optimizer sections timed on the host, kept as per-section totals."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - began


def loop(stack: Stack, batches: list[torch.Tensor], clip: bool,
         section: Section = _no_section) -> tuple[float, float]:
    """Run one pass over `batches`; return (CPU seconds, wall seconds). CPU is the process's,
    except on two ranks: there gloo's threads spin while a rank waits for its peer, and their
    CPU follows the peer's timing, so the training thread's CPU is counted (the hook's flusher
    thread, every 0.25 s, is then left out)."""
    clock = time.thread_time if dist.get_world_size() > 1 else time.process_time
    cpu, wall = clock(), time.perf_counter()
    for x in batches:
        stack.forward_backward(x, section)
        with section("optimizer"):
            if clip:
                torch.nn.utils.clip_grad_norm_(stack.model.parameters(), 1.0)
            stack.optimizer.step()
            stack.optimizer.zero_grad(set_to_none=True)
    return clock() - cpu, time.perf_counter() - wall


def peer_sections() -> tuple[str, Section | None]:
    """nvidia-resiliency-ext's detection sections, or None where the package cannot load."""
    try:
        import nvidia.cuda_cupti  # libcupti, which the peer's C module links against

        for lib in glob.glob(os.path.join(next(iter(nvidia.cuda_cupti.__path__)), "lib",
                                          "libcupti.so*")):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        import nvidia_resiliency_ext
        from nvidia_resiliency_ext import straggler

        straggler.Detector.initialize(scores_to_compute=["relative_perf_scores"],
                                      gather_on_rank0=False, report_time_interval=1e9)
    except Exception as exc:  # not installed, or no libcupti
        print(f"nvidia-resiliency-ext not usable here ({exc!r}); peer = CPU sections")
        return "CPU sections (perf_counter)", None
    version = getattr(nvidia_resiliency_ext, "__version__", "")
    return (f"nvidia-resiliency-ext {version} straggler sections".replace("  ", " "),
            lambda name: straggler.Detector.detection_section(name, profile_cuda=False))


def _opened(stack: Stack, variant: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    options = variant.get("watch")
    return robust_metrics.watch(stack.watched, stack.optimizer, **options) if options else \
        contextlib.nullcontext()


def run_variant(stack: Stack, batches: list[torch.Tensor], clip: bool,
                variant: dict[str, Any]) -> tuple[float, float]:
    """(CPU, wall) seconds per step of the shared model under one variant. The watch is opened
    before and closed after the timed loop: it leaves nothing behind (DDP keeps its own
    all-reduce), so one model serves every variant and model-to-model differences do not enter."""
    section = variant.get("section", _no_section)
    with _opened(stack, variant):
        loop(stack, batches[:5], clip, section)  # the watch's first steps: untimed
        cpu, wall = loop(stack, batches, clip, section)
    return cpu / len(batches), wall / len(batches)


_WRAPPERS = ("wrapper", "wait", "issue", "wait_tensor", "wait_event", "wait_stream")


def count_calls(stack: Stack, batches: list[torch.Tensor], clip: bool,
                variant: dict[str, Any]) -> tuple[float, float]:
    """(Python calls, wrapped collective calls) per step under one variant, counted with
    `sys.setprofile` over `batches` on this thread: the same on any machine."""
    section = variant.get("section", _no_section)
    folder = os.path.join("robust_metrics", "hooks", "collectives")
    calls = wrapped = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, wrapped
        if event == "call":
            calls += 1
            code = frame.f_code
            if code.co_name in _WRAPPERS and folder in code.co_filename:
                wrapped += 1

    with _opened(stack, variant):
        loop(stack, batches[:5], clip, section)
        sys.setprofile(profile)
        try:
            loop(stack, batches, clip, section)
        finally:
            sys.setprofile(None)
    return calls / len(batches), wrapped / len(batches)


def measure(variants: dict[str, dict[str, Any]], clip: bool, steps: int, rounds: int,
            kind: str = "ddp") -> tuple[dict[str, dict[str, float]], float]:
    """Interleaved rounds; returns per variant the added CPU and wall per step (median of paired
    rounds, and fastest minus fastest), the Python calls and wrapped collective calls it adds
    per step, and the baseline's fastest CPU step."""
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank
    batches = [torch.randn(64, 256, generator=generator) for _ in range(steps)]
    stack = make(kind)
    loop(stack, batches, clip)  # warm-up, outside the measurement
    names = list(variants)
    counted = {name: count_calls(stack, batches[:20], clip, variants[name]) for name in names}
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(run_variant(stack, batches, clip, variants[name]))
    base = times["baseline"]
    out = {}
    for name in names[1:]:
        row: dict[str, float] = {}
        for i, clock in enumerate(("cpu", "wall")):
            paired = [v[i] - b[i] for v, b in zip(times[name], base, strict=True)]
            row[f"{clock}_median_us"] = 1e6 * statistics.median(paired)
            row[f"{clock}_min_us"] = 1e6 * (min(v[i] for v in times[name]) -
                                            min(b[i] for b in base))
        row["calls"] = counted[name][0] - counted["baseline"][0]
        row["wrapped"] = counted[name][1]
        out[name] = row
    return out, min(b[0] for b in base)


def section_costs(sections: dict[str, Section]) -> dict[str, float]:
    """CPU time per step of entering and leaving the three sections, called directly."""
    import timeit

    def three(section: Section) -> Callable[[], None]:
        def run() -> None:
            with section("forward"):
                pass
            with section("backward"):
                pass
            with section("optimizer"):
                pass

        return run

    return {name: min(timeit.repeat(three(section), number=2000, repeat=7)) / 2000
            for name, section in sections.items()}


def callback_costs() -> dict[str, float]:
    """CPU time of each hook callback per step, called directly (min of repeats: deterministic,
    unlike the end-to-end A/B on a shared machine)."""
    import timeit

    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    loss = net(x).pow(2).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    handle = robust_metrics.watch(net, optimizer, backend="null", run="bench")
    timer, steps, numerics = handle.tracker.timer, handle.steps, handle.numerics

    def step_end() -> None:
        numerics.losses.add(loss, source=numerics.losses.CAPTURED)
        numerics.grad_norm = norm
        steps.on_step_end(optimizer, (), {})

    def forward() -> None:
        steps.awaiting_forward = True
        steps.on_forward(net, (x,))

    def grad_norm() -> None:
        numerics.grad_norm = None
        numerics.on_pre_step(optimizer, (), {})

    def ddp_points() -> None:
        timer.grad_ready()
        timer.backward_end()

    import torch.distributed.distributed_c10d as c10d

    payload, gathered = torch.randn(256), torch.empty(256)
    wrapped_gather = c10d.all_gather_single  # the watch's wrapper, while the watch is open
    original_gather = wrapped_gather.__wrapped__  # functools.wraps keeps what it wraps

    def collective_wrapper() -> None:
        wrapped_gather(gathered, payload)

    def collective_plain() -> None:
        original_gather(gathered, payload)

    def async_and_wait() -> None:
        wrapped_gather(gathered, payload, async_op=True).wait()

    cases = {"collective wrapper: sync all_gather_single (incl. the collective)": collective_wrapper,
             "collective wrapper: same call unwrapped": collective_plain,
             "collective wrapper: async all_gather_single + Work.wait": async_and_wait,
             "step end (incl. loss and norm read, step timer)": step_end,
             "forward pre-hook": forward,
             "loss capture in backward()": lambda: numerics.capture_loss(loss),
             "DDP timing points (gradient ready, backward end)": ddp_points,
             "gradient norm when the user does not clip": grad_norm}
    try:
        return {name: min(timeit.repeat(fn, number=2000, repeat=7)) / 2000
                for name, fn in cases.items()}
    finally:
        handle.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=25, help="interleaved rounds (>= 21)")
    parser.add_argument("--stack", choices=("ddp", "fsdp2", "pp"), default="ddp")
    args = parser.parse_args()
    if args.rounds < 21 or args.steps < 20:
        parser.error("--rounds must be at least 21 and --steps at least 20")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    if args.stack != "ddp":  # two ranks: one stage each, or FSDP2's shards
        import torch.multiprocessing as mp

        mp.spawn(run_rank, args=(2, args), nprocs=2, join=True)
    else:
        run_rank(0, 1, args)


def run_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report = rank == 0
    folder = tempfile.mkdtemp(prefix="robust-bench-")
    peer_name, peer = peer_sections()
    cpu_sections = CpuSections()
    hook = {"backend": "multiprocess", "metrics_dir": folder, "run": "bench", "port": 19750,
            "rank": rank, "world_size": world, "checkpoint_signal": None}
    variants: dict[str, dict[str, Any]] = {
        "baseline": {},
        "hook, defaults": {"watch": hook},
        "hook, collectives=False": {"watch": {**hook, "collectives": False}},
        "CPU sections (perf_counter)": {"section": cpu_sections.section},
    }
    if peer is not None:
        variants[peer_name] = {"section": peer}
    results, base = measure(variants, clip=True, steps=args.steps, rounds=args.rounds,
                            kind=args.stack)
    if not report:
        dist.destroy_process_group()
        return
    clock = "training thread" if world > 1 else "process"
    print(f"\n{args.stack}: baseline step (fastest round): {1e3 * base:.3f} ms CPU ({clock}), "
          f"{args.rounds} interleaved rounds of {args.steps} steps, clip_grad_norm_ on, "
          "multiprocess backend")
    print("| variant | added CPU per step, median / min | added wall per step, median / min "
          "| Python calls added per step | wrapped collective calls per step |\n"
          "|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['cpu_median_us']:.1f} / {r['cpu_min_us']:.1f} µs | "
              f"{r['wall_median_us']:.1f} / {r['wall_min_us']:.1f} µs | {r['calls']:.1f} | "
              f"{r['wrapped']:.1f} |")
    peer_key = peer_name if peer is not None else "CPU sections (perf_counter)"
    hook, off, peer_row = (results["hook, defaults"], results["hook, collectives=False"],
                           results[peer_key])
    for stat in ("median", "min"):
        key = f"cpu_{stat}_us"
        print(f"hook defaults minus peer ({peer_key}), {stat}: {hook[key] - peer_row[key]:+.1f} µs"
              " CPU per step")
    if hook["wrapped"]:
        for stat in ("median", "min"):
            key = f"cpu_{stat}_us"
            print(f"collective timing per wrapped call (defaults minus collectives=False), "
                  f"{stat}: {(hook[key] - off[key]) / hook['wrapped']:.2f} µs CPU")
    if args.stack != "ddp":
        dist.destroy_process_group()
        return
    print("\n| hook callback | CPU per call |\n|---|---|")
    costs = callback_costs()
    for name, seconds in costs.items():
        print(f"| {name} | {1e6 * seconds:.1f} µs |")
    per_step = sum(v for k, v in costs.items()
                   if not k.startswith(("gradient norm", "collective wrapper")))
    print(f"| sum per step when the user clips (DDP) | {1e6 * per_step:.1f} µs |")
    sections = {"CPU sections (perf_counter)": cpu_sections.section}
    if peer is not None:
        sections[peer_name] = peer
    print("\n| peer, three sections per step | CPU per step |\n|---|---|")
    for name, seconds in section_costs(sections).items():
        print(f"| {name} | {1e6 * seconds:.1f} µs |")
    # No straggler.Detector.shutdown(): without a GPU it crashes the process (CUPTI teardown).
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
