"""A small model, a plain training loop and a watched series' value: what the hook's in-process
tests (tests/test_hook.py, tests/test_timing.py, tests/test_pod_annotations.py) train and read."""

from __future__ import annotations

import torch

from robust_metrics.hooks.watch import Watch


def value(handle: Watch, name: str, **labels: str) -> float:
    """The value of a watched handle's series `name` with these labels (KeyError if none)."""
    for sample in handle.store.samples():
        series = sample.series
        got = dict(zip(series.spec.labels, series.labels, strict=True))
        if sample.name == name and all(got.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError(name)


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A seeded two-layer MLP on 8 features and its SGD optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, *,
          accumulate: int = 1, clip: float | None = None, nan_step: int = -1) -> list[float]:
    """A plain loop; returns the mean loss of each optimizer step as the user computes it."""
    means = []
    for step in range(steps):
        total = 0.0
        for _ in range(accumulate):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            if step == nan_step:
                loss = loss * float("nan")
            total += float(loss.detach())
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        means.append(total / accumulate)
    return means
