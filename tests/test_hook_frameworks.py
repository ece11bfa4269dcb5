"""The hook's knowledge of framework wrappers (robust_metrics/hooks/frameworks.py), in one
process: a DeepSpeed-shaped optimizer, torch's two-phase clip, Accelerate's backward. The real
frameworks on real ranks: tests/integration/test_frameworks_*.py."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import robust_metrics
from tests.hook_models import value


class DeepSpeedOptimizer:
    """Named as DeepSpeed's base class, which the hook recognises."""


class ZeroLike(DeepSpeedOptimizer):
    """As DeepSpeed's ZeRO 1/2 optimizer: steps its torch optimizer once per parameter group,
    after computing the global gradient norm (here: the norm times `world`, as if the other
    ranks held the rest), and skips the step on overflow."""

    def __init__(self, model: torch.nn.Module, world: float = 2.0) -> None:
        weights = [p for p in model.parameters() if p.dim() > 1]
        biases = [p for p in model.parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.SGD([{"params": weights}, {"params": biases}], lr=0.01)
        self.world = world
        self.overflow = False
        self._global_grad_norm: Any = 0.0

    def step(self) -> None:
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"]]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if not torch.isfinite(norm):
            self.overflow = True
            self._global_grad_norm = float("inf")
            return
        self.overflow = False
        self._global_grad_norm = norm * self.world
        everything = self.optimizer.param_groups
        for group in everything:
            self.optimizer.param_groups = [group]
            self.optimizer.step()
        self.optimizer.param_groups = everything

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return model(torch.randn(4, 8)).pow(2).mean()


def test_a_deepspeed_optimizer_counts_its_own_step_once_with_its_global_norm(
        model: torch.nn.Module) -> None:
    optimizer = ZeroLike(model)
    with robust_metrics.watch(model, optimizer, backend="null", run="unit") as handle:
        for _ in range(3):
            loss_of(model).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert value(handle, "robust_steps_total") == 3  # not 6: two parameter groups
        norm = float(optimizer._global_grad_norm)
        assert math.isclose(value(handle, "robust_grad_norm"), norm, rel_tol=1e-6)
        (loss_of(model) * float("inf")).backward()  # an fp16 overflow: DeepSpeed skips
        optimizer.step()
        optimizer.zero_grad()
        assert value(handle, "robust_steps_total") == 4
        assert value(handle, "robust_grad_norm") == pytest.approx(norm)  # not the stale inf
    assert "step" not in vars(optimizer)  # the class's step serves again


def test_the_norm_given_to_clip_grads_with_norm_is_the_steps(model: torch.nn.Module) -> None:
    """Accelerate's FSDP2 clip computes the whole model's norm itself, then clips with it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with robust_metrics.watch(model, optimizer, backend="null", run="unit") as handle:
        loss_of(model).backward()
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1e9, torch.tensor(7.5))
        optimizer.step()
        assert value(handle, "robust_grad_norm") == pytest.approx(7.5)
        optimizer.zero_grad()
        loss_of(model).backward()  # no clip: the norm the hook computes from the gradients
        own = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        optimizer.step()
        assert value(handle, "robust_grad_norm") == pytest.approx(float(own), rel=1e-5)


@pytest.fixture
def accelerator() -> Iterator[Any]:
    accelerate = pytest.importorskip("accelerate", reason="the huggingface extra is not installed")
    from accelerate.state import AcceleratorState, GradientState

    yield accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_the_loss_given_to_accelerator_backward_is_published_undivided(
        model: torch.nn.Module, accelerator: Any) -> None:
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    original = type(accelerator).backward
    with robust_metrics.watch(model, optimizer, backend="null", run="unit") as handle:
        losses = []
        for _ in range(2):  # one optimizer step of two micro-batches
            with accelerator.accumulate(model):
                loss = loss_of(model)
                losses.append(float(loss.detach()))
                accelerator.backward(loss)  # backward runs on loss / 2
                optimizer.step()
                optimizer.zero_grad()
        assert value(handle, "robust_steps_total") == 1
        assert value(handle, "robust_loss") == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert type(accelerator).backward is original
