"""The hook in one process: what it publishes, and that nothing it does can stop training."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

import robust_metrics
from robust_metrics.hooks import sinks
from robust_metrics.hooks.watch import Watch
from robust_metrics.rankfolder.control import write_checkpoint_request
from tests.hook_models import make_model, train, value
from tests.support import free_port, require_binary


@pytest.fixture
def watched() -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer, list[Watch]]]:
    model, optimizer = make_model()
    handles: list[Watch] = []
    yield model, optimizer, handles
    for h in handles:
        h.close()


def start(watched_: tuple, **options: object) -> Watch:  # type: ignore[type-arg]
    model, optimizer, handles = watched_
    options.setdefault("backend", "null")
    options.setdefault("run", "unit")
    options.setdefault("rank", 0)
    options.setdefault("world_size", 1)
    handle = robust_metrics.watch(model, optimizer, **options)
    handles.append(handle)
    return handle


def test_steps_loss_and_timing_are_published(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    before = time.time()
    losses = train(watched[0], watched[1], 5, accumulate=3)
    assert value(handle, "robust_steps_total") == 5
    assert value(handle, "robust_global_step") == 5
    assert value(handle, "robust_last_step_timestamp_seconds") >= before
    assert value(handle, "robust_step_duration_seconds_count") == 5
    assert value(handle, "robust_step_compute_seconds_count") == 5
    assert value(handle, "robust_data_wait_seconds_count") == 4  # no wait before the first step
    assert value(handle, "robust_loss") == pytest.approx(losses[-1], rel=1e-5)
    assert value(handle, "robust_phase", phase="train") == 1


def test_grad_norm_is_what_clip_grad_norm_returned(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    model, optimizer, _ = watched
    model(torch.randn(4, 8)).pow(2).mean().backward()
    returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    optimizer.step()
    assert value(handle, "robust_grad_norm") == pytest.approx(float(returned), rel=1e-6)


def test_grad_norm_is_computed_when_the_user_does_not_clip(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    model, optimizer, _ = watched
    model(torch.randn(4, 8)).pow(2).mean().backward()
    expected = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters()]))
    optimizer.step()
    assert value(handle, "robust_grad_norm") == pytest.approx(float(expected), rel=1e-5)


def test_a_nan_loss_counts_exactly_one_nonfinite_step(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    model, optimizer, _ = watched
    for step in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        if step == 2:
            loss = loss * float("nan")
        loss.backward()
        if step == 2:  # skip the poisoned update, as AMP's GradScaler does
            for p in model.parameters():
                p.grad.zero_()
        optimizer.step()
        optimizer.zero_grad()
    assert value(handle, "robust_nonfinite_loss_steps_total") == 1
    assert math.isfinite(value(handle, "robust_loss"))
    assert value(handle, "robust_nonfinite_first_step") == 3  # the third step of this process


def test_the_first_nonfinite_step_is_the_global_step_and_stays_the_first(
        watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched, start_step=100)  # resumed from a checkpoint at step 100
    model, optimizer, _ = watched
    train(model, optimizer, 2)
    with pytest.raises(KeyError):  # no series before a NaN
        value(handle, "robust_nonfinite_first_step")
    for _ in range(2):  # steps 103 and 104 both non-finite
        (model(torch.randn(4, 8)).pow(2).mean() * float("nan")).backward()
        for p in model.parameters():
            p.grad.zero_()
        optimizer.step()
        optimizer.zero_grad()
    assert value(handle, "robust_nonfinite_loss_steps_total") == 2
    assert value(handle, "robust_nonfinite_first_step") == 103


def test_the_batch_of_the_first_nonfinite_step_is_named(
        watched: tuple) -> None:  # type: ignore[type-arg]
    offsets = iter(range(0, 1000, 16))  # the sample offset of each step's batch
    handle = start(watched, batch_position=lambda: next(offsets))
    model, optimizer, _ = watched
    for step in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        (loss * float("nan") if step == 2 else loss).backward()
        if step == 2:
            for p in model.parameters():
                p.grad.zero_()
        optimizer.step()
        optimizer.zero_grad()
    assert value(handle, "robust_nonfinite_first_step") == 3
    assert value(handle, "robust_nonfinite_first_batch") == 32  # the third batch


def test_a_failing_batch_position_is_a_hook_error_not_a_training_error(
        watched: tuple) -> None:  # type: ignore[type-arg]
    def broken() -> int:
        raise LookupError("no sampler state")

    handle = start(watched, batch_position=broken)
    model, optimizer, _ = watched
    (model(torch.randn(4, 8)).pow(2).mean() * float("nan")).backward()
    optimizer.step()
    assert value(handle, "robust_hook_errors_total", where="batch_position") == 1
    assert value(handle, "robust_nonfinite_first_step") == 1
    with pytest.raises(KeyError):
        value(handle, "robust_nonfinite_first_batch")
    with pytest.raises(ValueError, match="batch_position=3: must be a callable"):
        robust_metrics.watch(model, optimizer, backend="null", batch_position=3)


def test_nonfinite_gradients_are_counted(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    model, optimizer, _ = watched
    model(torch.randn(4, 8)).pow(2).mean().backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    assert value(handle, "robust_nonfinite_grad_steps_total") == 1
    assert value(handle, "robust_nonfinite_first_step") == 1


def test_explicit_loss_wins_over_the_captured_one(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    model, optimizer, _ = watched
    (model(torch.randn(4, 8)).pow(2).mean() * 1024).backward()  # a scaled loss, as with AMP
    handle.loss(0.5)
    optimizer.step()
    assert value(handle, "robust_loss") == 0.5


@pytest.mark.parametrize("options, message", [
    ({"backend": "kafka"}, "backend='kafka'"),
    ({"rank": -1}, "rank=-1"),
    ({"rank": 4, "world_size": 2}, "rank=4 is not below world_size=2"),
    ({"port": 70000}, "port=70000"),
    ({"topology": {"dp": 1}}, "topology key 'dp'"),
    ({"checkpoint": "save"}, "checkpoint= must be a callable"),
    ({"run": 'a"b'}, "run="),
    ({"trace_every": 5}, "trace_every= needs trace_dir="),
    ({"flops_per_step": -1.0}, "flops_per_step=-1.0"),
    ({"flops_per_step": float("inf")}, "flops_per_step=inf"),
    ({"flops_per_step": "6e12"}, "flops_per_step='6e12'"),
])
def test_bad_options_fail_at_watch_with_the_option_named(
        watched: tuple, options: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        start(watched, **options)


def test_unknown_option_is_named(watched: tuple) -> None:  # type: ignore[type-arg]
    with pytest.raises(TypeError, match="checkpoint_fn"):
        start(watched, checkpoint_fn=print)


def test_watch_twice_in_one_process_is_refused(watched: tuple) -> None:  # type: ignore[type-arg]
    start(watched)
    with pytest.raises(RuntimeError, match="already active"):
        start(watched)


def test_exceptions_inside_the_hook_never_reach_training(
        watched: tuple, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    handle = start(watched)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(handle.tracker.timer, "step_end", broken)
    monkeypatch.setattr(handle.numerics.losses, "add", broken)
    monkeypatch.setattr(handle.steps, "on_gc", broken, raising=True)
    monkeypatch.setattr(handle.sink, "flush", broken)
    train(watched[0], watched[1], 3)  # must not raise
    assert value(handle, "robust_hook_errors_total", where="step") == 3
    assert value(handle, "robust_hook_errors_total", where="loss") >= 3


def test_a_failing_metrics_folder_never_stops_training(watched: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    handle = start(watched, backend="multiprocess", metrics_dir=str(not_a_folder))
    train(watched[0], watched[1], 3)
    assert value(handle, "robust_steps_total") == 3
    assert value(handle, "robust_hook_errors_total", where="sink") == 1


def test_multiprocess_files_are_read_by_prometheus_client(watched: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    handle = start(watched, backend="multiprocess", metrics_dir=str(tmp_path), flush_interval=0)
    train(watched[0], watched[1], 4)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("robust_steps_total", {"run": "unit", "rank": "0"}) == 4
    assert registry.get_sample_value(
        "robust_step_duration_seconds_count", {"run": "unit", "rank": "0"}) == 4
    info = registry.get_sample_value("robust_rank_info", {
        "run": "unit", "rank": "0", "local_rank": "0", "world_size": "1", "node": handle.options.node,
        "pid": str(os.getpid()), "dp_rank": "", "pp_rank": "", "tp_rank": ""})
    assert info == 1
    assert (tmp_path / "ranks" / f"{os.getpid()}.json").exists()


def test_in_process_endpoint_passes_promtool(watched: tuple) -> None:  # type: ignore[type-arg]
    promtool = require_binary("promtool")
    port = free_port()
    start(watched, backend="http", port=port)
    train(watched[0], watched[1], 3)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    assert b'robust_steps_total{rank="0",run="unit"} 3.0' in text
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip() == b"" and check.stderr.strip() == b""


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_the_endpoint_serves_the_step_age_on_the_ranks_clock_once_it_has_stepped(
        watched: tuple, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    """The rules read a rank's step age from one series whether the sidecar or the rank serves
    it: in-process it is the scrape's time minus the last step, so a rank that steps faster than
    it is scraped never reads as hung, and one stuck in a step shows its age growing."""
    age = 'robust_rank_step_age_seconds{rank="0",run="unit"}'
    port = free_port()
    handle = start(watched, backend="http", port=port)
    assert age not in _scrape(port)  # no step yet: the sidecar alone counts from watch()
    train(watched[0], watched[1], 1)
    last = value(handle, "robust_last_step_timestamp_seconds")
    monkeypatch.setattr(sinks, "time", SimpleNamespace(time=lambda: last + 42.5))
    assert _scrape(port)[age] == 42.5


def test_the_multiprocess_files_never_hold_a_step_age(
        watched: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    """The sidecar computes the age from the files; an age written to them would be stale."""
    start(watched, backend="multiprocess", metrics_dir=str(tmp_path), flush_interval=0)
    train(watched[0], watched[1], 2)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    names = {s.name for family in registry.collect() for s in family.samples}
    assert "robust_steps_total" in names and "robust_rank_step_age_seconds" not in names


def test_a_taken_port_never_stops_training(watched: tuple) -> None:  # type: ignore[type-arg]
    import socket

    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        handle = start(watched, backend="http", port=blocker.getsockname()[1])
        train(watched[0], watched[1], 2)
    assert value(handle, "robust_steps_total") == 2
    assert value(handle, "robust_hook_errors_total", where="sink") == 1


def test_checkpoint_request_file_runs_the_callback_once_at_a_step_boundary(
        watched: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    calls: list[int] = []
    handle = start(watched, backend="multiprocess", metrics_dir=str(tmp_path),
                   checkpoint=calls.append, control_poll_interval=0)
    train(watched[0], watched[1], 2)
    request = write_checkpoint_request(str(tmp_path))
    train(watched[0], watched[1], 3)
    assert calls == [3]
    assert value(handle, "robust_checkpoint_request_id") == request.id
    assert value(handle, "robust_last_checkpoint_timestamp_seconds") > 0
    assert value(handle, "robust_phase", phase="train") == 1


def test_checkpoint_request_at_step_waits_for_that_step(watched: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    calls: list[int] = []
    start(watched, backend="multiprocess", metrics_dir=str(tmp_path), checkpoint=calls.append,
          control_poll_interval=0)
    write_checkpoint_request(str(tmp_path), at_step=4)
    train(watched[0], watched[1], 6)
    assert calls == [4]


def test_sigusr1_requests_a_checkpoint(watched: tuple) -> None:  # type: ignore[type-arg]
    calls: list[int] = []
    handle = start(watched, checkpoint=calls.append, start_step=100)
    train(watched[0], watched[1], 1)
    os.kill(os.getpid(), signal.SIGUSR1)
    train(watched[0], watched[1], 1)
    assert calls == [102]
    assert value(handle, "robust_checkpoint_request_id") > 0


def test_a_failing_checkpoint_is_counted_and_training_goes_on(watched: tuple) -> None:  # type: ignore[type-arg]
    def fail(step: int) -> None:
        raise OSError("disk full")

    handle = start(watched, checkpoint=fail)
    train(watched[0], watched[1], 1)
    os.kill(os.getpid(), signal.SIGUSR1)
    train(watched[0], watched[1], 2)
    assert value(handle, "robust_checkpoint_failures_total") == 1
    assert value(handle, "robust_checkpoint_request_id") > 0
    assert value(handle, "robust_last_checkpoint_timestamp_seconds") == 0


def test_phase_context_restores_train(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    with handle.phase("eval"):
        assert value(handle, "robust_phase", phase="eval") == 1
        assert value(handle, "robust_phase", phase="train") == 0
    assert value(handle, "robust_phase", phase="train") == 1
    with pytest.raises(ValueError, match="phase 'warmup'"):
        handle.phase("warmup")


def test_close_removes_every_patch(watched: tuple) -> None:  # type: ignore[type-arg]
    backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
    import torch.distributed as dist

    all_reduce = dist.all_reduce
    handle = start(watched)
    assert torch.Tensor.backward is not backward and dist.all_reduce is not all_reduce
    handle.close()
    assert torch.Tensor.backward is backward
    assert torch.nn.utils.clip_grad_norm_ is clip
    assert dist.all_reduce is all_reduce


def test_set_step_after_resume(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    handle.set_step(500)
    train(watched[0], watched[1], 2)
    assert value(handle, "robust_global_step") == 502
    assert value(handle, "robust_steps_total") == 2


def test_gc_pauses_are_timed(watched: tuple) -> None:  # type: ignore[type-arg]
    import gc

    handle = start(watched)
    gc.collect()
    assert value(handle, "robust_gc_pause_seconds_count") >= 1


def test_files_stay_current_while_the_training_thread_is_blocked(
        watched: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    """A rank stuck in a collective still shows the collective it entered (RankHang needs it)."""
    handle = start(watched, backend="multiprocess", metrics_dir=str(tmp_path), flush_interval=0.05)
    train(watched[0], watched[1], 1)
    handle.tracker.launch("all_reduce", "default_pg", 4)  # entered, never completes: a hang

    def entered() -> float | None:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        return registry.get_sample_value("robust_collectives_entered_total",
                                         {"run": "unit", "rank": "0", "group": "default_pg"})

    from tests.support import wait_until

    assert wait_until(entered, timeout=5, message="entered collective in the files") == 1


def test_time_in_eval_is_not_part_of_the_next_step(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    train(watched[0], watched[1], 2)
    before = value(handle, "robust_step_duration_seconds_sum")
    with handle.phase("eval"):
        time.sleep(0.3)
    train(watched[0], watched[1], 1)
    assert value(handle, "robust_step_duration_seconds_sum") - before < 0.25


def test_leaving_a_phase_publishes_a_fresh_step_timestamp_with_it(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    train(watched[0], watched[1], 1)
    with handle.phase("checkpoint"):
        time.sleep(0.3)
        stale = value(handle, "robust_last_step_timestamp_seconds")
        assert time.time() - stale >= 0.3
    left = time.time()
    assert value(handle, "robust_phase", phase="train") == 1
    assert left - value(handle, "robust_last_step_timestamp_seconds") < 0.1
    # the timestamp is written before the phase flips: its series was created first, and the
    # multiprocess writer and the /metrics collector both write in creation order
    names = [s.name for s in handle.store.samples()]
    assert names.index("robust_last_step_timestamp_seconds") < names.index("robust_phase")


def test_no_loss_or_grad_norm_sample_before_the_first_value(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    for name in ("robust_loss", "robust_grad_norm"):
        with pytest.raises(KeyError):
            value(handle, name)
    losses = train(watched[0], watched[1], 1)
    assert value(handle, "robust_loss") == pytest.approx(losses[0], rel=1e-5)
    assert value(handle, "robust_grad_norm") > 0


def test_a_short_loss_spike_is_counted_at_every_step(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched, grad_norm=False)
    model, optimizer = watched[0], watched[1]
    scale = {"factor": 1.0}
    batches = torch.Generator().manual_seed(0)  # the same losses whatever ran before
    for step in range(150):
        if step == 99:
            with pytest.raises(KeyError):  # no spike yet: no series
                value(handle, "robust_loss_spikes_total")
        scale["factor"] = 30.0 if 100 <= step < 105 else 1.0
        loss = model(torch.randn(16, 8, generator=batches)).pow(2).mean() * scale["factor"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert value(handle, "robust_loss_spikes_total") == 5


def test_spike_detector_warms_up_and_accepts_a_new_level() -> None:
    from robust_metrics.hooks.numerics import SpikeDetector

    detector = SpikeDetector(warmup=10, accept_after=5)
    assert not any(detector.update(v) for v in [1.0, 1.1] * 5)  # warmup
    assert detector.update(30.0)
    assert not detector.update(1.0)
    assert [detector.update(5.0) for _ in range(5)] == [True] * 5  # a new level: accepted...
    assert not detector.update(5.0)  # ...and warming up again
    assert not detector.update(float("nan"))


def test_large_first_values_do_not_hide_a_later_spike() -> None:
    """Early training has large gradient norms; folded into the running variance they would
    raise the bar above a 20x spike 150 steps later."""
    from robust_metrics.hooks.numerics import SpikeDetector

    detector = SpikeDetector(relative=0.5)
    values = [4.0, 3.0, 3.5, 2.5] + [0.1, 0.2] * 73
    assert not any(detector.update(v) for v in values)
    assert detector.update(3.0)


def test_close_marks_the_identity_finished_and_an_exception_does_not(
        watched: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    import json

    from robust_metrics.hooks import watch as watch_module

    identity = tmp_path / "ranks" / f"{os.getpid()}.json"
    handle = start(watched, backend="multiprocess", metrics_dir=str(tmp_path))
    assert "finished" not in json.loads(identity.read_text())
    before = time.time()
    with pytest.raises(RuntimeError), handle:
        raise RuntimeError("a crash inside the with block")
    data = json.loads(identity.read_text())
    assert "finished" not in data
    assert before <= data["crashed"] <= time.time()  # when it failed, on the rank's clock

    second = tmp_path / "second"
    handle = start(watched, backend="multiprocess", metrics_dir=str(second))
    handle.close()
    data = json.loads((second / "ranks" / f"{os.getpid()}.json").read_text())
    assert time.time() - data["finished"] < 5
    assert watch_module._active is None


def test_time_blocked_in_a_phase_is_not_taken_from_the_next_step(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    train(watched[0], watched[1], 2)
    with handle.phase("checkpoint"):
        timer = handle.tracker.timer  # e.g. 3 s in a barrier while another rank writes
        timer.blocked(timer.mark() - 3.0)
    train(watched[0], watched[1], 1)
    durations = value(handle, "robust_step_duration_seconds_sum")
    computes = value(handle, "robust_step_compute_seconds_sum")
    assert computes == pytest.approx(durations, rel=1e-6), "the phase's blocked time leaked"


def test_flops_per_step_counts_model_flops_at_every_step(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched, flops_per_step=2.5e9)
    train(watched[0], watched[1], 4)
    assert value(handle, "robust_model_flops_total") == 4 * 2.5e9


def test_a_flops_callable_is_asked_at_each_step(watched: tuple) -> None:  # type: ignore[type-arg]
    tokens = iter([100, 200, 300])
    handle = start(watched, flops_per_step=lambda: 6 * 1000 * next(tokens))
    train(watched[0], watched[1], 3)
    assert value(handle, "robust_model_flops_total") == 6 * 1000 * 600


def test_without_flops_per_step_no_flops_series_exists(watched: tuple) -> None:  # type: ignore[type-arg]
    handle = start(watched)
    train(watched[0], watched[1], 2)
    with pytest.raises(KeyError):
        value(handle, "robust_model_flops_total")


def test_a_broken_flops_callable_never_reaches_training(watched: tuple) -> None:  # type: ignore[type-arg]
    def fail() -> float:
        raise RuntimeError("injected failure")

    answers = iter([lambda: 1e9, lambda: torch.tensor(1e9), lambda: float("nan"), fail])
    handle = start(watched, flops_per_step=lambda: next(answers)())
    train(watched[0], watched[1], 4)  # must not raise
    # step 1 counts; a tensor and a NaN are refused; step 4's callable raises
    assert value(handle, "robust_model_flops_total") == 1e9
    assert value(handle, "robust_hook_errors_total", where="flops") == 3


def test_an_uncaught_exception_at_interpreter_exit_writes_when_the_rank_crashed(
        tmp_path: Path) -> None:
    """No `with`, no close(): the exit handler finds the exception that ended the program and
    writes the crash time, which the sidecar orders a run's failures by."""
    import json

    script = ("import time, torch, robust_metrics\n"
              "model = torch.nn.Linear(2, 2)\n"
              "robust_metrics.watch(model, torch.optim.SGD(model.parameters(), lr=0.1),\n"
              f"    backend='multiprocess', metrics_dir={str(tmp_path)!r}, run='r', rank=0,\n"
              "    world_size=1)\n"
              "print(time.time(), flush=True)\n"
              "raise RuntimeError('injected')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "injected" in proc.stderr, proc.stderr[-2000:]
    raised_after = float(proc.stdout.split()[-1])
    identities = list((tmp_path / "ranks").glob("*.json"))
    assert len(identities) == 1
    data = json.loads(identities[0].read_text())
    assert "finished" not in data
    assert raised_after <= data["crashed"] <= raised_after + 10, data


def test_the_step_windows_are_of_the_same_compute_the_summary_observes(watched: tuple) -> None:  # type: ignore[type-arg]
    """The straggler rules compare each rank's window means and spread: they must be of the same
    per-step compute the summary observes (step minus blocked time), every timed step counted
    (a GPU step's events can time two steps at once), in every published window; but the
    first, timed from its first forward without the wait before it, which is no step time."""
    handle = start(watched)
    timed = iter([[(0.5, 0.2)], [(0.7, 0.1)], [(0.4, 0.4)], [(1.0, 0.0), (0.9, 0.3)]])
    handle.steps.timed_steps = lambda host_seconds: next(timed)  # type: ignore[method-assign]
    train(watched[0], watched[1], 4)
    assert value(handle, "robust_step_compute_seconds_count") == 5
    assert value(handle, "robust_step_compute_seconds_sum") == pytest.approx(
        0.3 + 0.6 + 0.0 + 1.0 + 0.6)
    computes = [0.6, 0.0, 1.0, 0.6]  # the windows: every timed step but the first
    mean = sum(computes) / 4
    for window in ("1m", "2m", "5m"):  # the steps took well under a second: all in every window
        assert value(handle, "robust_step_compute_mean_seconds", window=window) == pytest.approx(
            mean)
    for window in ("2m", "5m"):
        assert value(handle, "robust_step_duration_mean_seconds",
                     window=window) == pytest.approx((0.7 + 0.4 + 1.0 + 0.9) / 4)
    assert value(handle, "robust_window_steps", window="1m") == 4
    spread = math.sqrt(sum((c - mean) ** 2 for c in computes) / 4)
    assert value(handle, "robust_step_compute_variation_ratio", window="1m") == pytest.approx(
        spread / mean)


@pytest.mark.parametrize("backend", ["multiprocess", "http"])
def test_the_step_windows_are_served_by_the_sidecar_files_and_the_endpoint(
        watched: tuple, tmp_path: Path, backend: str) -> None:  # type: ignore[type-arg]
    port = free_port()
    handle = start(watched, backend=backend, metrics_dir=str(tmp_path), port=port,
                   flush_interval=0)
    handle.steps.timed_steps = lambda host_seconds: [(0.5, 0.2)]  # type: ignore[method-assign]
    train(watched[0], watched[1], 3)
    expected = {("robust_step_compute_mean_seconds", "1m"): 0.3,
                ("robust_step_duration_mean_seconds", "5m"): 0.5,
                ("robust_step_compute_variation_ratio", "1m"): 0.0,
                ("robust_window_steps", "1m"): 2.0}  # the first step is no step time
    if backend == "http":
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        served = {(sample.name, sample.labels.get("window")): sample.value
                  for family in text_string_to_metric_families(text.decode())
                  for sample in family.samples
                  if sample.labels.get("run") == "unit" and sample.labels.get("rank") == "0"}
    else:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        served = {key: registry.get_sample_value(key[0], {"run": "unit", "rank": "0",
                                                          "window": key[1]})
                  for key in expected}
    # equal steps: the spread is 0 up to the rounding of E[c^2] - E[c]^2 (about 1e-8)
    assert {key: served.get(key) for key in expected} == pytest.approx(expected, abs=1e-6)
