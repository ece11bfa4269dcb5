"""Mixed precision under `watch()`: a step the GradScaler skips is a step of the loop, bf16
autocast changes nothing, and the published loss is the one the user computed."""

from __future__ import annotations

import torch

import robust_metrics
from robust_metrics import schema


def _value(handle: robust_metrics.Watch, spec: schema.MetricSpec) -> float | None:
    found = [s for s in handle.store.all_series() if s.spec is spec]
    return found[0].value if found else None


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_a_skipped_step_is_counted_timed_and_not_a_nonfinite_gradient() -> None:
    model, optimizer = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    with robust_metrics.watch(model, optimizer, backend="null", run="amp", rank=0,
                              checkpoint_signal=None) as handle:
        for step in range(12):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            scaled = scaler.scale(loss)
            if step % 3 == 2:  # an overflow: the scaler skips this step and halves its scale
                scaled = scaled * float("inf")
            scaled.backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert handle.global_step == 12
        assert _value(handle, schema.STEPS_TOTAL) == 12
        assert _value(handle, schema.SKIPPED_STEPS) == 4
        assert _value(handle, schema.NONFINITE_GRAD) == 0
        assert _value(handle, schema.NONFINITE_LOSS) == 0
        assert _value(handle, schema.STEP_DURATION) is not None
        assert 0 < _value(handle, schema.LOSS) < 10  # the loss, not loss x 1024
        assert _value(handle, schema.HOOK_ERRORS) is None
    assert scaler.get_scale() < 2.0 ** 10


def test_bf16_autocast_steps_as_usual_and_spends_no_series_on_skips() -> None:
    model, optimizer = _model()
    with robust_metrics.watch(model, optimizer, backend="null", run="bf16", rank=0,
                              checkpoint_signal=None) as handle:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert _value(handle, schema.STEPS_TOTAL) == 5
        assert _value(handle, schema.SKIPPED_STEPS) is None
        assert _value(handle, schema.HOOK_ERRORS) is None


def test_a_disabled_grad_scaler_is_not_watched() -> None:
    model, optimizer = _model()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with robust_metrics.watch(model, optimizer, backend="null", run="off", rank=0,
                              checkpoint_signal=None) as handle:
        for _ in range(3):
            scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert _value(handle, schema.STEPS_TOTAL) == 3
        assert _value(handle, schema.SKIPPED_STEPS) is None
