"""The timing boundary in one process: DDP's two points on a real 1-rank gloo DDP model, and the
CUDA-event source faked at `torch.cuda.Event` (no GPU here; tests/gpu_sim.py proves the logic)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import robust_metrics
from robust_metrics import schema
from robust_metrics.hooks import timing
from robust_metrics.hooks.timing import CudaEvents, HostClock, StepTimer
from tests.hook_models import value


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp_model() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model = DDP(net)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_ddp_keeps_its_own_all_reduce_and_one_parameter_stays_hooked(gloo: None) -> None:
    model, optimizer = ddp_model()
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        for _ in range(3):
            step(model, optimizer)
        probe = handle.steps.ddp_probe
        assert probe.watched == 0  # the first layer's weight: its gradient is ready last
        assert len(probe._handles) == 1
        assert value(handle, "robust_step_compute_seconds_count") == 3
        assert value(handle, "robust_collective_duration_seconds_count", op="all_reduce",
                     group="default_pg") == 3  # the reduction of each step
        assert value(handle, "robust_collective_bytes_total", op="all_reduce",
                     group="default_pg") == 3 * probe.nbytes
    assert not model._get_ddp_logging_data().get("comm_hook")  # no Python comm hook
    assert not probe._handles  # close() removed the gradient hook


def test_the_window_ends_after_ddp_waited_for_its_buckets(gloo: None) -> None:
    """A slow all-reduce (a test comm hook whose future completes 50 ms later) is blocked time:
    the final callback runs after DDP's own, which waits for the buckets."""
    model, optimizer = ddp_model()
    seen_while_waiting: list[tuple[int, int]] = []

    def slow_all_reduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        future: torch.futures.Future = torch.futures.Future()

        def finish() -> None:
            _, entered, completed = handle.tracker.snapshot()
            seen_while_waiting.append((entered.get("default_pg", 0),
                                       completed.get("default_pg", 0)))
            future.set_result(bucket.buffer())

        threading.Timer(0.05, finish).start()
        return future

    model.register_comm_hook(None, slow_all_reduce)
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        for _ in range(3):
            step(model, optimizer)
        duration = value(handle, "robust_step_duration_seconds_sum")
        compute = value(handle, "robust_step_compute_seconds_sum")
    assert duration - compute >= 3 * 0.045, (duration, compute)
    assert compute < duration / 2
    # while a rank waits in DDP's reduction it shows entered = completed + 1 (RankHang's signal),
    # from the first step on (that step counts its entry at its first gradient)
    assert seen_while_waiting == [(1, 0), (2, 1), (3, 2)]


def test_micro_steps_under_no_sync_count_no_reduction(gloo: None) -> None:
    model, optimizer = ddp_model()
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        for _ in range(2):
            with model.no_sync():
                model(torch.randn(4, 8)).pow(2).mean().backward()
            step(model, optimizer)  # the last micro-step reduces
        assert value(handle, "robust_collective_duration_seconds_count", op="all_reduce",
                     group="default_pg") == 2


def test_a_changed_graph_hooks_every_parameter_again(gloo: None) -> None:
    model, optimizer = ddp_model()
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        step(model, optimizer)
        probe = handle.steps.ddp_probe
        assert probe.watched == 0
        first = model.module[0]
        x = torch.randn(4, 8)
        model.module[2](torch.relu(first(x).detach())).pow(2).mean().backward()  # skips layer 0
        optimizer.step()
        optimizer.zero_grad()
        assert probe.watched is None and len(probe._handles) == 4  # hooked all again
        step(model, optimizer)
        assert probe.watched == 0


class FakeEvent:
    """torch.cuda.Event at the library boundary: a device clock that the test advances."""

    device_now = 0.0
    cursor = 0.0
    elapsed_calls = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: object = None) -> None:
        self.at = FakeEvent.cursor

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.device_now

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):  # cudaErrorNotReady: would need a sync
            raise RuntimeError("elapsed_time on an event the device has not reached")
        FakeEvent.elapsed_calls += 1
        return 1000.0 * (end.at - self.at)  # type: ignore[operator]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.device_now, FakeEvent.cursor, FakeEvent.elapsed_calls = 0.0, 0.0, 0
    return FakeEvent


def test_cuda_event_steps_are_read_one_step_late(fake_cuda: type[FakeEvent]) -> None:
    timer = StepTimer(CudaEvents())
    results = []
    for k in range(4):  # each step: 10 ms, of which 3 ms blocked waiting in a collective
        fake_cuda.cursor = 10.0 * k + 0.004
        begin = timer.mark()
        fake_cuda.cursor = 10.0 * k + 0.007
        timer.blocked(begin)
        fake_cuda.cursor = 10.0 * (k + 1)
        fake_cuda.device_now = 10.0 * k  # the device is one step behind the host
        results.append(timer.step_end(host_seconds=0.001))
    assert results[0] == [] and all(len(r) == 1 for r in results[1:3])
    (first,), (second,) = results[1], results[2]
    assert first == pytest.approx((0.001, 0.001))  # no start mark: host time, blocked clipped
    assert second == pytest.approx((10.0, 0.003))


def test_the_watch_times_cuda_models_with_events(
        fake_cuda: type[FakeEvent], monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch picks CUDA events for a CUDA model and publishes a step once its events are
    reached; this fake device is always one step behind."""
    monkeypatch.setattr(timing, "source_for", lambda device: CudaEvents())
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        for k in range(4):
            fake_cuda.cursor = float(k + 1)
            fake_cuda.device_now = float(k)
            model(torch.randn(2, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert value(handle, "robust_step_duration_seconds_count") == 3  # the 4th: not reached
        # steps 1 and 2 from their events (1 s of device time each), step 0 from the host
        assert 2.0 <= value(handle, "robust_step_duration_seconds_sum") < 2.5
    assert fake_cuda.elapsed_calls == 2


class SideSource:
    """A TimingSource with two streams: the step's ("compute") and a side stream."""

    host = False

    def __init__(self) -> None:
        self.current, self.time = "compute", 0.0

    def mark(self) -> tuple[str, float]:
        return (self.current, self.time)

    def ready(self, mark: tuple[str, float]) -> bool:
        return True

    def elapsed(self, begin: tuple[str, float], end: tuple[str, float]) -> float:
        return end[1] - begin[1]

    def side_stream(self) -> str | None:
        return None if self.current == "compute" else self.current

    def is_step_stream(self, stream: object) -> bool:
        return stream == "compute"


def test_a_wait_on_a_side_stream_is_not_the_steps_and_the_stream_is_remembered() -> None:
    """FSDP2's all-gather stream waits for peers while compute runs: not blocked time."""
    source = SideSource()
    timer = StepTimer(source)
    source.current, source.time = "all_gather", 1.0
    begin = timer.mark()
    source.time = 1.5
    timer.blocked(begin)
    assert timer.side_streams == {"all_gather"}
    source.current = "compute"
    begin = timer.mark()
    source.time = 1.7
    timer.blocked(begin)  # the step's stream waited 0.2 s
    source.time = 2.0
    ((seconds, blocked),) = timer.step_end(host_seconds=2.0)
    assert (seconds, blocked) == pytest.approx((2.0, 0.2))  # not the side stream's 0.5 s


def test_a_cuda_timed_watch_wraps_stream_waits_and_restores_them(
        fake_cuda: type[FakeEvent], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the step's stream waits for side streams (hooks/collectives/streams.py): only while a watch
    times a CUDA model; a CPU model leaves torch.cuda.Stream alone."""
    originals = (torch.cuda.Stream.record_event, torch.cuda.Stream.wait_event)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with robust_metrics.watch(model, optimizer, backend="null", run="t"):
        assert (torch.cuda.Stream.record_event, torch.cuda.Stream.wait_event) == originals
    monkeypatch.setattr(timing, "source_for", lambda device: CudaEvents())
    with robust_metrics.watch(model, optimizer, backend="null", run="t"):
        assert torch.cuda.Stream.record_event._robust_metrics  # type: ignore[attr-defined]
        assert torch.cuda.Stream.wait_event._robust_metrics  # type: ignore[attr-defined]
    assert (torch.cuda.Stream.record_event, torch.cuda.Stream.wait_event) == originals


def test_host_clock_blocked_time_is_the_call(tmp_path: Path) -> None:
    timer = StepTimer(HostClock())
    begin = timer.mark()
    time.sleep(0.02)
    timer.blocked(begin)
    ((seconds, blocked),) = timer.step_end(host_seconds=0.05)
    assert seconds == 0.05 and 0.02 <= blocked <= 0.05


class Tick(torch.autograd.Function):
    """Advances the fake device clock: 10 ms in forward, 20 ms in backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        FakeEvent.cursor += 0.010
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        FakeEvent.cursor += 0.020
        return grad


def test_what_if_traces_of_a_cuda_model_come_from_events_one_step_late(
        fake_cuda: type[FakeEvent], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import json

    monkeypatch.setattr(timing, "source_for", lambda device: CudaEvents())
    linear = torch.nn.Linear(4, 1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Tick.apply(self.linear(x))

    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "trace-rank0.jsonl"
    with robust_metrics.watch(model, optimizer, backend="null", run="t", trace_dir=str(tmp_path),
                              trace_every=1, trace_steps=1):
        for k in range(3):
            fake_cuda.device_now = fake_cuda.cursor  # the device reached the previous step
            model(torch.randn(2, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            fake_cuda.cursor += 0.005
            if k == 0:
                assert not path.exists()  # step 0's events are not reached yet
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["step"] for r in rows} == {0, 1}
    by_op = {(r["step"], r["optype"]): r for r in rows}
    assert by_op[(1, "forward-compute")]["duration"] == pytest.approx(0.010)
    assert by_op[(1, "backward-compute")]["duration"] == pytest.approx(0.020)
    gap = by_op[(1, "forward-compute")]["start_ts"] - by_op[(0, "forward-compute")]["start_ts"]
    assert gap > 0


@pytest.mark.gpu
def test_a_cuda_model_is_timed_by_events_that_see_a_slow_kernel() -> None:
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA (install a CUDA build of torch on a GPU machine)")
    model = torch.nn.Linear(64, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(5_000_000)
    end.record()
    end.synchronize()
    slow = start.elapsed_time(end) / 1000.0
    with robust_metrics.watch(model, optimizer, backend="null", run="gpu") as handle:
        assert isinstance(handle.tracker.timer.source, CudaEvents)
        for _ in range(12):
            model(x).pow(2).mean().backward()
            torch.cuda._sleep(5_000_000)  # device time the host never waits for
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        model(x).pow(2).mean().backward()
        optimizer.step()
        summary = handle.store.series(schema.STEP_DURATION)
        assert summary.count >= 12
        # every step but the first (timed by the host: no start event) holds the slow kernel
        assert summary.sum >= 0.8 * slow * (summary.count - 1)


def _frames(run: Callable[[], None], count: int, where: tuple[str, ...] = ()) -> float:
    """Python frames entered per `run()` (those in files under `where` only, when given)."""
    frames = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal frames
        if event == "call" and (not where or any(w in frame.f_code.co_filename for w in where)):
            frames += 1

    sys.setprofile(profile)
    try:
        for _ in range(count):
            run()
    finally:
        sys.setprofile(None)
    return frames / count


def test_ddp_reduction_timing_costs_at_most_eleven_python_calls_a_step(gloo: None) -> None:
    """The DDP window (last gradient ready to backward's return) is timed every step in a few
    Python calls: the post-accumulate-grad hook, two final callbacks, the tracker and the step
    timer (21 before they were bound once and the host marks became perf_counter itself)."""
    model, optimizer = ddp_model()
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        for _ in range(3):
            step(model, optimizer)
        calls = _frames(lambda: step(model, optimizer), 10,
                        (os.path.join("hooks", "collectives"), os.path.join("hooks", "timing.py")))
        stats, entered, completed = handle.tracker.snapshot()
    assert calls <= 11, calls  # with the forward pre-hook's compiling() check
    assert stats[("all_reduce", "default_pg")].count == completed["default_pg"] == 13
    assert entered["default_pg"] == 13 and stats[("all_reduce", "default_pg")].seconds > 0


def test_a_wrapped_sync_collective_costs_at_most_sixteen_python_calls(gloo: None) -> None:
    """Counted, sized, timed as blocked and completed in about half the Python calls it took
    when the group's label was recomputed and three locks taken per call (30)."""
    payload = torch.ones(64)
    plain = _frames(lambda: dist.all_reduce(payload), 20)
    model, optimizer = ddp_model()
    with robust_metrics.watch(model, optimizer, backend="null", run="t") as handle:
        dist.all_reduce(payload)
        hooked = _frames(lambda: dist.all_reduce(payload), 20)
        stats, _, completed = handle.tracker.snapshot()
    assert hooked - plain <= 16, (hooked, plain)
    assert stats[("all_reduce", "default_pg")].count == completed["default_pg"] == 21
    assert stats[("all_reduce", "default_pg")].bytes == 21 * 64 * 4
