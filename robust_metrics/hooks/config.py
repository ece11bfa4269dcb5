"""Options of `watch()`, resolved from arguments and the launcher's environment.

Everything a user can get wrong is checked here, once, with a message that names the option, so
`watch()` fails loudly at start-up instead of quietly mid-run.
"""

from __future__ import annotations

import math
import os
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_PORT", "WatchOptions", "resolve_run_id"]

DEFAULT_PORT = 9750
"""In-process `/metrics` port of local rank 0; local rank N listens on DEFAULT_PORT + N."""

BACKENDS = ("auto", "multiprocess", "http", "otel", "null")


def resolve_run_id(env: Mapping[str, str]) -> str:
    """The job's identity: explicit, Slurm job id, torchrun run id, Kubeflow job name, or 'local'."""
    for var in ("ROBUST_METRICS_RUN", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PET_RUN_ID",
                "JOB_NAME"):
        value = env.get(var)
        if value and value != "none":
            return value
    return "local"


def _env_int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


def _env_float(env: Mapping[str, str], name: str) -> float:
    value = env[name]
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a number") from None


@dataclass
class WatchOptions:
    """Resolved options of one `watch()` call. See `robust_metrics.watch` for their meaning."""

    run: str
    rank: int
    local_rank: int
    world_size: int
    node: str
    backend: str
    metrics_dir: str | None
    port: int
    topology: dict[str, int] = field(default_factory=dict)
    checkpoint: Callable[[int], Any] | None = None
    checkpoint_signal: int | None = signal.SIGUSR1
    start_step: int = 0
    grad_norm: bool = True
    collectives: bool = True
    gc_pauses: bool = True
    flush_interval: float = 0.25
    control_poll_interval: float = 0.5
    pod_annotations: str | None = None
    trace_dir: str | None = None
    trace_every: int = 0
    trace_steps: int = 1
    flops_per_step: float | Callable[[], float] | None = None
    batch_position: Callable[[], int] | None = None
    time_scale: float = 1.0

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> WatchOptions:
        """Build options from keyword arguments, filling the rest from the environment."""
        env = os.environ if env is None else env
        unknown = set(kwargs) - set(cls.__dataclass_fields__)
        if unknown:
            valid = ", ".join(sorted(cls.__dataclass_fields__))
            raise TypeError(f"watch() got unknown option(s) {', '.join(sorted(unknown))}; "
                            f"valid options: {valid}")
        metrics_dir = kwargs.pop("metrics_dir", None) or env.get("ROBUST_METRICS_DIR") or None
        pod_annotations = (kwargs.pop("pod_annotations", None)
                           or env.get("ROBUST_METRICS_POD_ANNOTATIONS") or None)
        backend = kwargs.pop("backend", None) or env.get("ROBUST_METRICS_BACKEND") or "auto"
        if backend == "auto":
            backend = "multiprocess" if metrics_dir else "http"
        local_rank = kwargs.pop("local_rank", None)
        if local_rank is None:
            local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0)
        port = kwargs.pop("port", None)
        if port is None:
            port = _env_int(env, "ROBUST_METRICS_PORT", default=DEFAULT_PORT) + local_rank
        if "time_scale" not in kwargs and env.get("ROBUST_METRICS_TIME_SCALE"):
            kwargs["time_scale"] = _env_float(env, "ROBUST_METRICS_TIME_SCALE")
        options = cls(
            run=str(kwargs.pop("run", None) or resolve_run_id(env)),
            rank=kwargs.pop("rank", None) if "rank" in kwargs else _env_int(
                env, "RANK", "SLURM_PROCID", default=0),
            local_rank=local_rank,
            world_size=kwargs.pop("world_size", None) if "world_size" in kwargs else _env_int(
                env, "WORLD_SIZE", "SLURM_NTASKS", default=1),
            node=str(kwargs.pop("node", None) or env.get("ROBUST_METRICS_NODE")
                     or socket.gethostname()),
            backend=backend,
            metrics_dir=metrics_dir,
            port=port,
            pod_annotations=pod_annotations,
            **kwargs,
        )
        options.validate()
        return options

    def validate(self) -> None:
        """Raise ValueError with the option's name for any value that cannot work."""
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if not self.run or any(c in self.run for c in "\n\"\\"):
            raise ValueError(f"run={self.run!r}: must be a non-empty label value without "
                             "quotes, backslashes or newlines")
        for name in ("rank", "local_rank", "start_step", "trace_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r}: must be an integer >= 1")
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} is not below world_size={self.world_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port}: must be in 1..65535")
        for name in ("flush_interval", "control_poll_interval"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a number of seconds >= 0")
        if self.pod_annotations is not None and not isinstance(self.pod_annotations, str):
            raise ValueError(f"pod_annotations={self.pod_annotations!r}: must be the path of the "
                             "downward API annotations file")
        if self.checkpoint is not None and not callable(self.checkpoint):
            raise ValueError("checkpoint= must be a callable taking the step number")
        allowed = {"dp_rank", "pp_rank", "tp_rank"}
        for key, value in self.topology.items():
            if key not in allowed:
                raise ValueError(f"topology key {key!r}: use {', '.join(sorted(allowed))}")
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"topology[{key!r}]={value!r}: must be an integer >= 0")
        if self.trace_every and not self.trace_dir:
            raise ValueError("trace_every= needs trace_dir= (where sampled op traces go)")
        scale = self.time_scale
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0 \
                or not math.isfinite(scale):
            raise ValueError(f"time_scale={scale!r}: must be a number > 0 (the rules' "
                             "--time-scale; 1 at production intervals)")
        if self.trace_steps < 1:
            raise ValueError(f"trace_steps={self.trace_steps!r}: must be >= 1")
        if self.batch_position is not None and not callable(self.batch_position):
            raise ValueError(f"batch_position={self.batch_position!r}: must be a callable "
                             "returning the position of the step's batch (an int)")
        flops = self.flops_per_step
        if flops is not None and not callable(flops) and not valid_flops(flops):
            raise ValueError(f"flops_per_step={flops!r}: must be a finite number >= 0 or a "
                             "callable returning one")


def valid_flops(value: object) -> bool:
    """A FLOP count the hook can publish: a finite Python number >= 0 (a tensor would need a
    device synchronisation to read, so it is refused, not converted)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)
