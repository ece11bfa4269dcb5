"""Other sinks and the GPU-only paths, faked at the library boundary where no GPU exists."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch

import robust_metrics
from robust_metrics.hooks.collectives import CollectiveTracker
from robust_metrics.hooks.collectives.distributed import wrap_call


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_otel_backend_exports_the_same_names() -> None:
    pytest.importorskip("opentelemetry.sdk.metrics")
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with robust_metrics.watch(model, optimizer, backend="otel", run="otel", rank=0, world_size=1):
        for _ in range(3):
            _step(model, optimizer)
        data = reader.get_metrics_data()
    points = {m.name: list(m.data.data_points)
              for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    steps = points["robust_steps_total"]
    assert [p.value for p in steps] == [3]
    assert dict(steps[0].attributes) == {"run": "otel", "rank": "0"}
    assert "robust_step_duration_seconds_count" in points
    assert "robust_loss" in points
    [age] = points["robust_rank_step_age_seconds"]
    assert dict(age.attributes) == {"run": "otel", "rank": "0"} and 0 <= age.value < 5


class FakeNcclGroup(SimpleNamespace):
    """A process group at the library boundary: a sequence number that counts every collective
    entered (DDP's C++ buckets included) and the completion hook NCCL calls per collective."""

    def __init__(self) -> None:
        super().__init__(group_desc="dp", group_name="1", seq=5, hooks=[])

    def _get_sequence_number_for_group(self) -> int:
        return self.seq

    def _register_on_completion_hook(self, hook) -> None:  # type: ignore[no-untyped-def]
        self.hooks.append(hook)

    def finish(self, op_type: str, ms: float) -> None:
        info = SimpleNamespace(op_type=op_type, active_duration=datetime.timedelta(milliseconds=ms))
        for hook in self.hooks:
            hook(info)


def test_nccl_durations_come_from_the_completion_hook_not_futures() -> None:
    """The NCCL path: durations from WorkInfo, never from a host-side wait (faked boundary)."""
    pg = FakeNcclGroup()
    tracker = CollectiveTracker(on_error=lambda where, exc: pytest.fail(f"{where}: {exc}"))
    assert tracker.attach_nccl_completion_hook(pg)
    started = tracker.launch("all_reduce", "dp", 1024)
    pg.seq += 1
    tracker.complete("all_reduce", "dp", started)  # host-side return (an enqueue): not counted
    pg.finish("OpType.ALLREDUCE", 7)
    stats, entered, completed = tracker.snapshot()
    assert entered == {"dp": 1} and completed == {"dp": 1}
    assert stats[("all_reduce", "dp")].count == 1
    assert stats[("all_reduce", "dp")].seconds == pytest.approx(0.007)
    assert stats[("all_reduce", "dp")].bytes == 1024


def test_nccl_counts_tell_a_collective_never_launched_from_one_never_finished() -> None:
    """DDP's buckets never pass through Python: the group's sequence number counts them entered,
    the completion hook completed; a bucket launched and stuck on the device shows as the gap."""
    pg = FakeNcclGroup()
    tracker = CollectiveTracker(on_error=lambda where, exc: pytest.fail(f"{where}: {exc}"))
    tracker.attach_nccl_completion_hook(pg)
    pg.seq += 3  # three buckets launched by DDP's reducer
    pg.finish("OpType.ALLREDUCE", 2)
    pg.finish("OpType.ALLREDUCE", 2)
    tracker.ddp_reduction("dp", 4096, 0.0, 1.0)  # bytes only: the hook times the buckets
    stats, entered, completed = tracker.snapshot()
    assert (entered["dp"], completed["dp"]) == (3, 2)  # launched, one never finished: GPU side
    assert stats[("all_reduce", "dp")].count == 2 and stats[("all_reduce", "dp")].bytes == 4096


def test_an_nccl_group_made_after_watch_is_timed_by_its_completion_hook(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Host times of NCCL calls are enqueue times: a group's first collective attaches the hook,
    and the host-side return is not counted."""
    import torch.distributed as dist

    pg = FakeNcclGroup()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    tracker = CollectiveTracker(on_error=lambda where, exc: pytest.fail(f"{where}: {exc}"))

    def all_reduce(tensor: torch.Tensor, group: object = None) -> None:
        pg.seq += 1  # what the process group does when the call enqueues the collective

    wrapped = wrap_call(tracker, "all_reduce", "all_reduce", all_reduce)
    wrapped(torch.ones(4), group=pg)
    wrapped(torch.ones(4), group=pg)
    assert len(pg.hooks) == 1
    pg.finish("OpType.ALLREDUCE", 3)
    stats, entered, completed = tracker.snapshot()
    assert (entered["dp"], completed["dp"]) == (2, 1)  # one still running on the device
    assert stats[("all_reduce", "dp")].count == 1
    assert stats[("all_reduce", "dp")].seconds == pytest.approx(0.003)


def test_a_pending_collective_shows_as_entered_but_not_completed() -> None:
    tracker = CollectiveTracker(on_error=lambda where, exc: None)
    tracker.launch("all_reduce", "default_pg", 8)
    _, entered, completed = tracker.snapshot()
    assert entered == {"default_pg": 1}
    assert completed.get("default_pg", 0) == 0


@pytest.mark.gpu
def test_the_hook_adds_no_cuda_synchronisation() -> None:
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA (install a CUDA build of torch on a GPU machine)")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device="cuda")
    handle = robust_metrics.watch(model, optimizer, backend="null", run="gpu", rank=0,
                                  world_size=1)
    with handle:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(20):
                loss = model(x).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        handle.numerics.reader.poll()
        values = {s.name: s.value for s in handle.store.samples()}
    assert values["robust_steps_total"] == 20
    assert values["robust_loss"] > 0 and values["robust_grad_norm"] > 0
    assert values["robust_cuda_memory_allocated_bytes"] > 0
    assert values.get("robust_hook_errors_total", 0) == 0
