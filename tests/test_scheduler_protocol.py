"""Every scheduler adapter implements the whole `Scheduler` protocol, with its exact signatures.

The bridge calls `key=`, `completed()` and `close()` on every adapter without probing for them,
so an adapter that lacks one, or takes `key` positionally, must fail here rather than at 3 a.m.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from robust_metrics.bridge.schedulers import base

ADAPTERS = {
    "local": ("robust_metrics.bridge.schedulers.local", "LocalScheduler"),
    "webhook": ("robust_metrics.bridge.schedulers.webhook", "WebhookScheduler"),
    "slurm": ("robust_metrics.bridge.schedulers.slurm", "SlurmScheduler"),
    "kubernetes": ("robust_metrics.bridge.schedulers.kubernetes", "KubernetesScheduler"),
}
METHODS = ("signal", "restart", "drain_node", "cancel", "completed", "close")


def _adapter(name: str) -> type:
    module, cls = ADAPTERS[name]
    if name == "kubernetes":
        pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def _shape(fn: object) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_declares_what_exactly_once_needs() -> None:
    for method in METHODS:
        assert callable(getattr(base.Scheduler, method, None)), method
    for method in ("signal", "restart", "drain_node", "cancel"):
        key = inspect.signature(getattr(base.Scheduler, method)).parameters["key"]
        assert key.kind is inspect.Parameter.KEYWORD_ONLY and key.default is None


def test_every_builtin_adapter_is_listed_here() -> None:
    assert set(ADAPTERS) == set(base.names())


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_implements_every_method_with_the_protocols_signature(name: str) -> None:
    cls = _adapter(name)
    assert cls.name == name
    for method in METHODS:
        assert method in vars(cls), f"{cls.__name__} does not implement {method}()"
        assert _shape(getattr(cls, method)) == _shape(getattr(base.Scheduler, method)), (
            f"{cls.__name__}.{method}{inspect.signature(getattr(cls, method))} differs from "
            f"Scheduler.{method}{inspect.signature(getattr(base.Scheduler, method))}")


def test_the_adapters_say_when_completion_is_unknowable(tmp_path: object) -> None:
    slurm = _adapter("slurm")({})
    assert slurm.completed("123", "incident#0") is None
    slurm.close()
    local = _adapter("local")({"command": ["true"], "state_dir": str(tmp_path)})
    assert local.completed("r1", "incident#0") is False  # never started here
    local.close()
