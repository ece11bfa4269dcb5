"""Hook overhead: CPU time the hook adds per training step, against the same loop without it and
against a peer, nvidia-resiliency-ext's straggler sections, in the same run.

A 2-layer 256-wide MLP under DDP on a 1-rank gloo group (DDP's reducer and all-reduce are on the
path) with ~1.2 ms steps. One model trains under every variant in turn, `--steps` steps each,
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

Figures are process CPU seconds per step: per variant, the median over rounds of (variant -
baseline of the same round), and the difference of the fastest rounds. Run:

    .venv/bin/python bench/hook_overhead.py [--steps 100] [--rounds 40]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import robust_metrics

Section = Callable[[str], contextlib.AbstractContextManager[Any]]


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    model = DDP(net)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


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


def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
         clip: bool, section: Section = _no_section) -> tuple[float, float]:
    """Run one pass over `batches`; return (process CPU seconds, wall seconds)."""
    cpu, wall = time.process_time(), time.perf_counter()
    for x in batches:
        with section("forward"):
            loss = model(x).pow(2).mean()
        with section("backward"):
            loss.backward()
        with section("optimizer"):
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return time.process_time() - cpu, time.perf_counter() - wall


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


def run_variant(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                batches: list[torch.Tensor], clip: bool, variant: dict[str, Any]) -> float:
    """CPU seconds per step of the shared model under one variant. The watch is opened before
    and closed after the timed loop: it leaves nothing behind (DDP keeps its own all-reduce),
    so one model serves every variant and model-to-model differences do not enter."""
    options = variant.get("watch")
    section = variant.get("section", _no_section)
    context = robust_metrics.watch(model, optimizer, **options) if options else \
        contextlib.nullcontext()
    with context:
        loop(model, optimizer, batches[:5], clip, section)  # the watch's first steps: untimed
        return loop(model, optimizer, batches, clip, section)[0] / len(batches)


def measure(variants: dict[str, dict[str, Any]], clip: bool, steps: int, rounds: int,
            ) -> tuple[dict[str, dict[str, float]], float]:
    """Interleaved rounds; returns per variant the added CPU per step, and the baseline step."""
    batches = [torch.randn(64, 256) for _ in range(steps)]
    model, optimizer = make()
    loop(model, optimizer, batches, clip)  # warm-up, outside the measurement
    names = list(variants)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            cpu[name].append(run_variant(model, optimizer, batches, clip, variants[name]))
    base = cpu["baseline"]
    out = {}
    for name in names[1:]:
        paired = [v - b for v, b in zip(cpu[name], base, strict=True)]
        out[name] = {"median_us": 1e6 * statistics.median(paired),
                     "min_us": 1e6 * (min(cpu[name]) - min(base))}
    return out, min(base)


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
    timer = handle.tracker.timer

    def step_end() -> None:
        handle._losses.add(loss, source=handle._losses.CAPTURED)
        handle._grad_norm_from_clip = norm
        handle._on_step_end(optimizer, (), {})

    def forward() -> None:
        handle._awaiting_forward = True
        handle._on_forward(net, (x,))

    def grad_norm() -> None:
        handle._grad_norm_from_clip = None
        handle._on_pre_step(optimizer, (), {})

    def ddp_points() -> None:
        timer.grad_ready()
        timer.backward_end()

    cases = {"step end (incl. loss and norm read, step timer)": step_end,
             "forward pre-hook": forward,
             "loss capture in backward()": lambda: handle._capture_loss(loss),
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
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    folder = tempfile.mkdtemp(prefix="robust-bench-")
    peer_name, peer = peer_sections()
    cpu_sections = CpuSections()
    hook = {"backend": "multiprocess", "metrics_dir": folder, "run": "bench", "port": 19750}
    variants: dict[str, dict[str, Any]] = {
        "baseline": {},
        "hook, defaults": {"watch": hook},
        "hook, collectives=False": {"watch": {**hook, "collectives": False}},
        "CPU sections (perf_counter)": {"section": cpu_sections.section},
    }
    if peer is not None:
        variants[peer_name] = {"section": peer}
    results, base = measure(variants, clip=True, steps=args.steps, rounds=args.rounds)
    print(f"\nbaseline step (fastest round): {1e3 * base:.3f} ms CPU, {args.rounds} interleaved "
          f"rounds of {args.steps} steps, clip_grad_norm_ on, multiprocess backend")
    print("| variant | added CPU per step, median of paired rounds | fastest round minus "
          "fastest baseline | of the step |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_us']:.1f} µs | {r['min_us']:.1f} µs | "
              f"{100 * r['median_us'] * 1e-6 / base:.2f}% |")
    peer_key = peer_name if peer is not None else "CPU sections (perf_counter)"
    ratio = results["hook, defaults"]["median_us"] / max(results[peer_key]["median_us"], 1e-3)
    print(f"\nhook defaults / peer ({peer_key}): {ratio:.2f}x")
    print("\n| hook callback | CPU per call |\n|---|---|")
    costs = callback_costs()
    for name, seconds in costs.items():
        print(f"| {name} | {1e6 * seconds:.1f} µs |")
    per_step = sum(v for k, v in costs.items() if not k.startswith("gradient norm"))
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
