"""Every metric robust-metrics publishes, declared once.

The hook, the sidecar, the bridge, the alert rules, the dashboards and the README all refer to this
module; tests fail when a rule or dashboard names a metric that is not declared here. A metric is
data (`MetricSpec`), not a live prometheus_client object, so this module imports nothing heavy and
can be read by the sidecar, the bridge and the docs generator alike.

Names follow Prometheus conventions: base units, `_total` for counters, `_seconds`, `_bytes`.
Per-rank series carry `run` and `rank` only; topology lives on `robust_rank_info`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MetricSpec",
    "MetricType",
    "Source",
    "RANK_LABELS",
    "RANK_INFO_LABELS",
    "PHASES",
    "all_metrics",
    "get",
    "sample_names",
    "markdown_table",
]


class MetricType(enum.StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    SUMMARY = "summary"
    HISTOGRAM = "histogram"


class Source(enum.StrEnum):
    """Which process publishes the metric."""

    RANK = "rank"
    SIDECAR = "sidecar"
    BRIDGE = "bridge"


RANK_LABELS: tuple[str, ...] = ("run", "rank")
RANK_INFO_LABELS: tuple[str, ...] = (
    "run",
    "rank",
    "local_rank",
    "world_size",
    "node",
    "pid",
    "dp_rank",
    "pp_rank",
    "tp_rank",
)
PHASES: tuple[str, ...] = ("train", "eval", "checkpoint")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its exposed name, type, labels, unit and help text.

    `name` is the name as scraped (counters end in `_total`). `gauge_mode` is how
    prometheus_client's multiprocess mode merges a gauge across process files; rank gauges use
    `mostrecent` so a restarted rank's newest value wins and a hung rank's last value stays visible.
    """

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...]
    source: Source
    unit: str = ""
    gauge_mode: str = "mostrecent"
    buckets: tuple[float, ...] = ()
    default_on: bool = True

    @property
    def base_name(self) -> str:
        """The name prometheus_client wants at construction (counters without `_total`)."""
        if self.type is MetricType.COUNTER and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name

    def sample_names(self) -> tuple[str, ...]:
        """Names of the samples this metric exposes in the text format."""
        if self.type is MetricType.SUMMARY:
            return (f"{self.name}_sum", f"{self.name}_count")
        if self.type is MetricType.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


_REGISTRY: dict[str, MetricSpec] = {}


def _declare(
    name: str,
    type_: MetricType,
    help_: str,
    *,
    labels: Iterable[str] = RANK_LABELS,
    source: Source = Source.RANK,
    unit: str = "",
    gauge_mode: str = "mostrecent",
    buckets: tuple[float, ...] = (),
    default_on: bool = True,
) -> MetricSpec:
    if name in _REGISTRY:
        raise ValueError(f"metric {name} declared twice")
    if type_ is MetricType.COUNTER and not name.endswith("_total"):
        raise ValueError(f"counter {name} must end in _total")
    spec = MetricSpec(
        name, type_, help_, tuple(labels), source, unit, gauge_mode, buckets, default_on
    )
    _REGISTRY[name] = spec
    return spec


C, G, S, H = MetricType.COUNTER, MetricType.GAUGE, MetricType.SUMMARY, MetricType.HISTOGRAM

# --- rank: progress -------------------------------------------------------------------------
STEPS_TOTAL = _declare("robust_steps_total", C, "Optimizer steps completed by this rank process.")
LAST_STEP_TIMESTAMP = _declare(
    "robust_last_step_timestamp_seconds", G,
    "Unix time at which this rank last completed an optimizer step.", unit="seconds",
)
GLOBAL_STEP = _declare(
    "robust_global_step", G,
    "Training step counter including steps restored from a checkpoint.",
)
STEP_DURATION = _declare(
    "robust_step_duration_seconds", S,
    "Wall time of an optimizer step, from the end of the previous one.", unit="seconds",
)
STEP_COMPUTE = _declare(
    "robust_step_compute_seconds", S,
    "Step time minus time blocked in collectives; the straggler signal.", unit="seconds",
)
DATA_WAIT = _declare(
    "robust_data_wait_seconds", S,
    "Time from the end of an optimizer step to the next forward pass (data loading, host work).",
    unit="seconds",
)
GC_PAUSE = _declare(
    "robust_gc_pause_seconds", S, "Python garbage collector pauses in this rank process.",
    unit="seconds",
)
PHASE = _declare(
    "robust_phase", G,
    "1 for the phase the rank is in (train, eval, checkpoint), 0 for the others.",
    labels=(*RANK_LABELS, "phase"),
)

# --- rank: numerics -------------------------------------------------------------------------
LOSS = _declare("robust_loss", G, "Loss of the last step, averaged over accumulation micro-steps.")
GRAD_NORM = _declare("robust_grad_norm", G, "Total L2 norm of the gradients of the last step.")
NONFINITE_LOSS = _declare(
    "robust_nonfinite_loss_steps_total", C, "Steps whose loss was NaN or infinite."
)
NONFINITE_GRAD = _declare(
    "robust_nonfinite_grad_steps_total", C, "Steps whose gradient norm was NaN or infinite."
)

# --- rank: collectives ----------------------------------------------------------------------
COLLECTIVE_DURATION = _declare(
    "robust_collective_duration_seconds", S,
    "Time from a collective's launch to its completion, by op kind and process group.",
    labels=(*RANK_LABELS, "op", "group"), unit="seconds",
)
COLLECTIVE_BYTES = _declare(
    "robust_collective_bytes_total", C,
    "Payload bytes of collectives issued by this rank, by op kind and process group.",
    labels=(*RANK_LABELS, "op", "group"), unit="bytes",
)
COLLECTIVES_ENTERED = _declare(
    "robust_collectives_entered_total", C,
    "Collectives this rank has launched in a process group. A hung job's culprit lags here.",
    labels=(*RANK_LABELS, "group"),
)
COLLECTIVES_COMPLETED = _declare(
    "robust_collectives_completed_total", C,
    "Collectives of this rank that have completed in a process group.",
    labels=(*RANK_LABELS, "group"),
)

# --- rank: device memory --------------------------------------------------------------------
CUDA_ALLOCATED = _declare(
    "robust_cuda_memory_allocated_bytes", G, "CUDA memory held by tensors.", unit="bytes"
)
CUDA_RESERVED = _declare(
    "robust_cuda_memory_reserved_bytes", G, "CUDA memory reserved by the caching allocator.",
    unit="bytes",
)
CUDA_PEAK = _declare(
    "robust_cuda_memory_peak_bytes", G, "Peak CUDA memory held by tensors since start.",
    unit="bytes",
)

# --- rank: identity, checkpoints, self-health -----------------------------------------------
RANK_INFO = _declare(
    "robust_rank_info", G,
    "Always 1; topology of a rank. Join with * on(run, rank) group_left(node, ...).",
    labels=RANK_INFO_LABELS,
)
CHECKPOINT_REQUEST_ID = _declare(
    "robust_checkpoint_request_id", G,
    "Id of the last checkpoint request this rank has handled (acknowledgement).",
)
LAST_CHECKPOINT_TIMESTAMP = _declare(
    "robust_last_checkpoint_timestamp_seconds", G,
    "Unix time at which this rank's last checkpoint callback succeeded.", unit="seconds",
)
CHECKPOINT_DURATION = _declare(
    "robust_checkpoint_duration_seconds", G,
    "Duration of this rank's last successful checkpoint callback.", unit="seconds",
)
CHECKPOINT_FAILURES = _declare(
    "robust_checkpoint_failures_total", C, "Checkpoint callbacks that raised an exception."
)
HOOK_ERRORS = _declare(
    "robust_hook_errors_total", C,
    "Exceptions caught inside the hook; training went on. `where` names the hook part.",
    labels=(*RANK_LABELS, "where"),
)

# --- sidecar (robust_metrics/sidecar) -------------------------------------------------------
# Sidecar collectors declare their metrics in this section.

# --- bridge (robust_metrics/bridge) ---------------------------------------------------------
# The action bridge declares its metrics in this section.

del C, G, S, H


def all_metrics(source: Source | None = None) -> tuple[MetricSpec, ...]:
    """Every declared metric, optionally only those of one publisher."""
    return tuple(m for m in _REGISTRY.values() if source is None or m.source is source)


def get(name: str) -> MetricSpec:
    """The spec of a metric by its exposed name; KeyError names the unknown metric."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not declared in robust_metrics.schema") from None


def sample_names() -> dict[str, MetricSpec]:
    """Every sample name that can appear in a scrape, mapped to its metric."""
    return {s: m for m in _REGISTRY.values() for s in m.sample_names()}


def markdown_table() -> str:
    """The metric reference table for the README."""
    rows = [
        "| metric | type | labels | source | help |",
        "|---|---|---|---|---|",
    ]
    for m in _REGISTRY.values():
        labels = ", ".join(f"`{label}`" for label in m.labels)
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {m.source} | {m.help} |")
    return "\n".join(rows) + "\n"
