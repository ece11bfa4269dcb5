"""The scheduler adapter interface: the few operations the bridge asks of a job scheduler.

Adapters are chosen by name in the bridge policy (`local`, `webhook`, `slurm`, `kubernetes`) and
built from their own config block. Every operation names the run (the `run` label: Slurm job id,
PyTorchJob name, ...) and returns an `ActionResult`; an adapter raises `SchedulerError` with a
message a person can act on when the scheduler refuses or cannot be reached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from robust_metrics.configuration import ConfigError

__all__ = [
    "ActionResult",
    "Scheduler",
    "SchedulerError",
    "check_keys",
    "create",
    "names",
    "register",
]


class SchedulerError(RuntimeError):
    """The scheduler refused the operation or could not be reached."""


@dataclass(frozen=True)
class ActionResult:
    ok: bool
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Scheduler(Protocol):
    """What the bridge asks of a job scheduler; every adapter implements all of it.

    Exactly-once rests on three parts of this contract:

    - `key`: every operation gets the bridge step's idempotency key (`<incident>#<step>`).
      An adapter passes it on where the scheduler can keep it (the `local` state file, the
      webhook's `Idempotency-Key` header, the Kubernetes checkpoint annotation) and ignores it
      where it cannot (Slurm).
    - `completed(run, key)`: after a crash of the bridge, whether operation `key` finished
      (True), did not (False), or cannot be known (None). Only True resumes a step as done;
      None fails it rather than repeat a restart.
    - `close()`: release connections and reap children when the bridge stops.

    `signal` is how the `checkpoint` action reaches the ranks when no sidecar is configured
    (SIGUSR1; on Kubernetes a pod annotation the hook reads); an adapter that cannot deliver a
    signal raises `SchedulerError` saying so.
    """

    name: str

    def signal(self, run: str, signum: int, *, key: str | None = None) -> ActionResult:
        """Send a signal to every task of the run (SIGUSR1 asks the hook for a checkpoint)."""
        ...

    def restart(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        """Stop the run's processes and start them again (they resume from their checkpoint)."""
        ...

    def drain_node(self, node: str, reason: str, *, key: str | None = None) -> ActionResult:
        """Take a node out of scheduling, naming the alert that caused it."""
        ...

    def cancel(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        """Stop the run for good."""
        ...

    def completed(self, run: str, key: str) -> bool | None:
        """Whether the operation with idempotency key `key` finished; None when unknowable."""
        ...

    def close(self) -> None:
        """Release what the adapter holds (connections, child processes); called once at stop."""
        ...


def check_keys(config: Mapping[str, Any], allowed: Iterable[str], scheduler: str) -> None:
    """Refuse keys an adapter does not know, naming them and the allowed ones (a typo in a
    policy must stop the bridge at start, not act differently at 3 a.m.)."""
    known = set(allowed)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(f"{scheduler} scheduler: unknown key(s) {', '.join(unknown)} "
                          f"(allowed: {', '.join(sorted(known))})")


# An adapter factory: the scheduler's block of the policy (without `type`) and the folder its
# relative paths resolve against (the policy file's).
Factory = Callable[[Mapping[str, Any], Path], Scheduler]
_FACTORIES: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    """Factory decorator: make an adapter available by `name` in the policy."""

    def decorate(factory: Factory) -> Factory:
        _FACTORIES[name] = factory
        return factory

    return decorate


_BUILTIN_MODULES = {
    "local": "robust_metrics.bridge.schedulers.local",
    "webhook": "robust_metrics.bridge.schedulers.webhook",
    "slurm": "robust_metrics.bridge.schedulers.slurm",
    "kubernetes": "robust_metrics.bridge.schedulers.kubernetes",
}


def names() -> list[str]:
    return sorted(set(_FACTORIES) | set(_BUILTIN_MODULES))


def create(name: str, config: Mapping[str, Any], base_dir: str | Path = ".") -> Scheduler:
    """Build the adapter called `name` from its config block; relative paths in it resolve
    against `base_dir`. ConfigError names the valid choices or the bad key."""
    if name not in _FACTORIES and name in _BUILTIN_MODULES:
        import importlib

        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ConfigError(f"unknown scheduler {name!r}: choose one of {', '.join(names())}") from None
    return factory(config, Path(base_dir))
