"""Every metric robust-metrics publishes, declared once.

The hook, the sidecar, the bridge, the alert rules, the dashboards and docs/metrics.md all refer
to this module; tests fail when a rule or dashboard names a metric that is not declared here. A metric is
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
    "NODE_PROGRESS_LABELS",
    "NODE_SUMMARY_LABELS",
    "PHASES",
    "RANK_INFO_LABELS",
    "RANK_LABELS",
    "WINDOW_LABELS",
    "MetricSpec",
    "MetricType",
    "Source",
    "all_metrics",
    "get",
    "markdown_table",
    "sample_names",
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
    `default_on` is false for a metric published only when its option is set; `on_event` is true
    for one that appears only after an event (a spike, a stop, an exit): neither counts in a
    healthy rank's series budget.
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
    on_event: bool = False

    @property
    def base_name(self) -> str:
        """The name prometheus_client wants at construction (counters without `_total`)."""
        if self.type is MetricType.COUNTER and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name

    def sample_names(self) -> tuple[str, ...]:
        """Names of the samples this metric exposes in the text format."""
        if self.type is MetricType.SUMMARY and "quantile" in self.labels:
            return (self.name, f"{self.name}_sum", f"{self.name}_count")
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
    on_event: bool = False,
) -> MetricSpec:
    if name in _REGISTRY:
        raise ValueError(f"metric {name} declared twice")
    if type_ is MetricType.COUNTER and not name.endswith("_total"):
        raise ValueError(f"counter {name} must end in _total")
    spec = MetricSpec(
        name, type_, help_, tuple(labels), source, unit, gauge_mode, buckets, default_on,
        on_event
    )
    _REGISTRY[name] = spec
    return spec


C, G, S, H = MetricType.COUNTER, MetricType.GAUGE, MetricType.SUMMARY, MetricType.HISTOGRAM

# --- rank: progress -------------------------------------------------------------------------
STEPS_TOTAL = _declare("robust_steps_total", C, "Optimizer steps completed by this rank process.")
LAST_STEP_TIMESTAMP = _declare(
    "robust_last_step_timestamp_seconds", G,
    "Unix time at which this rank last completed an optimizer step or returned to training from "
    "eval or checkpoint (published with the phase change, so leaving a phase is never a hang).",
    unit="seconds",
)
GLOBAL_STEP = _declare(
    "robust_global_step", G,
    "Training step counter including steps restored from a checkpoint.",
)
START_STEP = _declare(
    "robust_start_step", G,
    "Global step this rank process started from: 0, or the step it resumed from after a restart "
    "(`start_step` or `set_step`). With robust_global_step it says how many steps a restart redid.",
)
STEP_DURATION = _declare(
    "robust_step_duration_seconds", S,
    "Wall time of an optimizer step, from the end of the previous one.", unit="seconds",
)
STEP_COMPUTE = _declare(
    "robust_step_compute_seconds", S,
    "Step time minus time blocked in collectives; the straggler signal.", unit="seconds",
)
# Windows the hook keeps (hooks/windows.py): ready values the straggler and slow-rank rules
# compare with instant selectors instead of deriving them from the summaries with rate().
WINDOW_LABELS: tuple[str, ...] = (*RANK_LABELS, "window")
STEP_COMPUTE_MEAN = _declare(
    "robust_step_compute_mean_seconds", G,
    "Mean compute time per step (robust_step_compute_seconds) of the steps that ended within "
    "`window` (1m, 2m, 5m) before this rank's last step end, kept by the hook on the rank's "
    "clock. Changes only at step ends: a hung rank's last value stays.",
    labels=WINDOW_LABELS, unit="seconds",
)
STEP_DURATION_MEAN = _declare(
    "robust_step_duration_mean_seconds", G,
    "Mean wall time per step (robust_step_duration_seconds) of the steps that ended within "
    "`window` (2m, 5m) before this rank's last step end. Minus robust_step_compute_mean_seconds "
    "of the same window it is the time blocked in collectives per step.",
    labels=WINDOW_LABELS, unit="seconds",
)
STEP_COMPUTE_VARIATION = _declare(
    "robust_step_compute_variation_ratio", G,
    "Coefficient of variation (standard deviation / mean) of compute time per step over the "
    "steps that ended within `window` (1m) before this rank's last step end: the step-to-step "
    "spread against which the straggler rules test whether a rank is consistently slower.",
    labels=WINDOW_LABELS,
)
WINDOW_STEPS = _declare(
    "robust_window_steps", G,
    "Steps that ended within `window` (1m) before this rank's last step end: the sample size of "
    "the window's means.",
    labels=WINDOW_LABELS,
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
MODEL_FLOPS = _declare(
    "robust_model_flops_total", C,
    "Model FLOPs this rank computed, flops_per_step of watch() per optimizer step (the MFU "
    "numerator). Published only when flops_per_step is set.",
    default_on=False,
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
NONFINITE_FIRST_STEP = _declare(
    "robust_nonfinite_first_step", G,
    "Global step of this rank process's first step whose loss or gradient norm was NaN or "
    "infinite. After a restart from a checkpoint the same step comes again: a non-finite value "
    "there again follows the data or the model (persistent), none follows the machine "
    "(transient). Appears at that step.", on_event=True,
)
NONFINITE_FIRST_BATCH = _declare(
    "robust_nonfinite_first_batch", G,
    "Position of the batch of robust_nonfinite_first_step, as watch()'s batch_position callable "
    "returned it (a sample offset, say). Published only with batch_position, at that step.",
    default_on=False, on_event=True,
)
SKIPPED_STEPS = _declare(
    "robust_skipped_steps_total", C,
    "Steps whose update the GradScaler skipped because its scaled gradients overflowed (inf or "
    "NaN); each is also a step of robust_steps_total. A storm of them means the loss scale is "
    "collapsing. Published only by ranks that step through a torch.amp.GradScaler.",
    default_on=False,
)
LOSS_SPIKES = _declare(
    "robust_loss_spikes_total", C,
    "Steps whose loss exceeded this rank's running mean by 6 standard deviations plus 10% "
    "(after a warmup of 50 steps); counted by the hook at every step, so a spike of one step counts. "
    "Appears at the first spike.", on_event=True,
)
GRAD_NORM_SPIKES = _declare(
    "robust_grad_norm_spikes_total", C,
    "Steps whose gradient norm exceeded this rank's running mean by 6 standard deviations plus "
    "50% (after a warmup of 50 steps). Appears at the first spike.", on_event=True,
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
    labels=RANK_INFO_LABELS, gauge_mode="all",  # multiprocess mode keeps `pid` only in "all"
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
# Node-level series carry `node` (the sidecar's --node, default the host name); GPU series add
# `gpu` (NVML index). Per-rank series seen from outside the rank carry `run` and `rank` only.
SIDECAR = Source.SIDECAR
NODE = ("node",)
GPU = ("node", "gpu")
NIC_PORT = ("node", "device", "port")

COLLECTOR_DURATION = _declare(
    "robust_sidecar_collector_duration_seconds", G,
    "Time a sidecar collector took in the last scrape.", labels=("node", "collector"), source=SIDECAR,
    unit="seconds",
)
COLLECTOR_SUCCESS = _declare(
    "robust_sidecar_collector_success", G,
    "1 when the collector succeeded in the last scrape, 0 when it failed.",
    labels=("node", "collector"), source=SIDECAR,
)
CORRUPT_FILES = _declare(
    "robust_sidecar_corrupt_files_total", C,
    "Rank metric files the sidecar could not read and skipped.", labels=(), source=SIDECAR,
)
RANK_PROCESS_ALIVE = _declare(
    "robust_rank_process_alive", G,
    "1 while the rank's process exists, 0 once it has exited (until its files are cleaned up).",
    source=SIDECAR,
)
RANK_PROCESS_CPU = _declare(
    "robust_rank_process_cpu_seconds_total", C, "CPU time of the rank's process.",
    source=SIDECAR, unit="seconds",
)
RANK_PROCESS_RSS = _declare(
    "robust_rank_process_resident_memory_bytes", G, "Resident memory of the rank's process.",
    source=SIDECAR, unit="bytes",
)
RANK_PROCESS_STOPPED = _declare(
    "robust_rank_process_stopped", G,
    "1 while the rank's process is stopped (state T, e.g. SIGSTOP) or traced (state t); absent "
    "otherwise.",
    source=SIDECAR, on_event=True,
)
RANK_FINISHED = _declare(
    "robust_rank_finished", G,
    "1 once the rank's process ended normally (close() or interpreter exit without an uncaught "
    "exception) or was stopped on request (SIGTERM, SIGINT, SIGHUP seen at its exit), kept while "
    "the sidecar knows the process; absent before.", source=SIDECAR, on_event=True,
)
RANK_EXIT_TIMESTAMP = _declare(
    "robust_rank_exit_timestamp_seconds", G,
    "Unix time at which the rank's process exited (only for exited processes): when the rank "
    "wrote that an exception ended it, else its last write of its files when it wrote until it "
    "died (at most one write interval early), else when the kernel or the sidecar saw the exit; "
    "the earliest exit of a run names the rank that failed first. `pid` tells one process's "
    "exit from the next one's of the same rank (a restart that fails again before any scrape "
    "saw it alive).",
    labels=(*RANK_LABELS, "pid"), source=SIDECAR, unit="seconds", on_event=True,
)
RANK_EXIT_GLOBAL_STEP = _declare(
    "robust_rank_exit_global_step", G,
    "The global step an exited rank had reached, read from its files after its exit (only for "
    "exited processes): the step evidence of a crash, which no scrape may have caught alive.",
    source=SIDECAR, on_event=True,
)
RANK_EXIT_START_STEP = _declare(
    "robust_rank_exit_start_step", G,
    "The step an exited rank had started from (robust_start_step), read from its files after its "
    "exit (only for exited processes that stepped): where a restart that failed again before any "
    "scrape saw it resumed.", source=SIDECAR, on_event=True,
)
RANK_EXIT_LAST_STEP_TIMESTAMP = _declare(
    "robust_rank_exit_last_step_timestamp_seconds", G,
    "Unix time of an exited rank's last completed step, read from its files after its exit (only "
    "for exited processes that stepped): proof that a restarted run trained, on the rank's clock, "
    "when no scrape caught it alive.", source=SIDECAR, unit="seconds", on_event=True,
)
# Per-node summaries of the ranks' step windows (sidecar/collectors/node_summaries.py): the run-level
# straggler rules read one series per node and stage instead of one per rank (docs/architecture.md,
# "edge first"). Each is a summary over the node's ranks of one pipeline stage (pp_rank, absent
# without a pipeline): quantile 0 is their minimum, 0.5 their median, 1 their maximum. Without a
# sidecar the rule group robust-node-summaries records the same series from the ranks' own.
NODE_SUMMARY_LABELS: tuple[str, ...] = ("run", "node", "pp_rank", "window", "quantile")
NODE_STEP_COMPUTE_MEAN = _declare(
    "robust_node_step_compute_mean_seconds", S,
    "Over the node's ranks of one stage with a positive robust_step_compute_mean_seconds of "
    "`window`: its quantiles 0, 0.5 and 1, its sum and the number of ranks.",
    labels=NODE_SUMMARY_LABELS, source=SIDECAR, unit="seconds",
)
NODE_STEP_DURATION_MEAN = _declare(
    "robust_node_step_duration_mean_seconds", S,
    "Over the node's ranks of one stage with a positive robust_step_duration_mean_seconds of "
    "`window`: its median (quantile 0.5).",
    labels=NODE_SUMMARY_LABELS, source=SIDECAR, unit="seconds",
)
NODE_STEP_BLOCKED_MEAN = _declare(
    "robust_node_step_blocked_mean_seconds", S,
    "Over the node's ranks of one stage: the least mean time blocked in collectives per step "
    "(robust_step_duration_mean_seconds minus robust_step_compute_mean_seconds of `window`, at "
    "least 0) of any of them (quantile 0): the run's ideal communication time comes from the "
    "rank that waits least.",
    labels=NODE_SUMMARY_LABELS, source=SIDECAR, unit="seconds",
)
NODE_STEP_COMPUTE_VARIATION = _declare(
    "robust_node_step_compute_variation_ratio", S,
    "Over the node's ranks of one stage: the median (quantile 0.5) of "
    "robust_step_compute_variation_ratio of `window`.",
    labels=NODE_SUMMARY_LABELS, source=SIDECAR,
)
NODE_WINDOW_STEPS = _declare(
    "robust_node_window_steps", S,
    "Over the node's ranks of one stage: the median (quantile 0.5) of robust_window_steps of "
    "`window`.",
    labels=NODE_SUMMARY_LABELS, source=SIDECAR,
)
# Per-node summaries of the ranks' progress, read by the run-level hang, badput, ETTR,
# throughput, checkpoint and numerics rules (labels: run, node, and phase or quantile).
NODE_PROGRESS_LABELS: tuple[str, ...] = ("run", "node", "quantile")
NODE_RANK_STEP_AGE = _declare(
    "robust_node_rank_step_age_seconds", S,
    "Over the node's ranks that have neither exited nor finished: the least "
    "robust_rank_step_age_seconds (quantile 0). No rank of the run has stepped for the least of "
    "these over the run's nodes.",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR, unit="seconds",
)
NODE_RANK_PROCESS_ALIVE = _declare(
    "robust_node_rank_process_alive", S,
    "Over the node's rank processes: whether any is alive (quantile 1), and how many there are "
    "(_count), alive or exited.",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
NODE_GLOBAL_STEP = _declare(
    "robust_node_global_step", S,
    "Over the node's ranks: the highest robust_global_step (quantile 1).",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
NODE_STEPS = _declare(
    "robust_node_steps", S,
    "Over the node's ranks: the sum of their robust_steps_total (_sum, a counter that drops "
    "when a rank restarts) and how many ranks count steps (_count).",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
NODE_COLLECTIVES_ENTERED = _declare(
    "robust_node_collectives_entered", S,
    "Over the node's ranks: the sum of robust_collectives_entered_total over every process "
    "group (_sum): it grows while any of them enters collectives.",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
NODE_PHASE = _declare(
    "robust_node_phase", S,
    "Over the node's ranks: the least (quantile 0) and the greatest (quantile 1) robust_phase "
    "of each `phase`: some rank is out of training when train's least is 0, in a checkpoint "
    "when checkpoint's greatest is 1.",
    labels=("run", "node", "phase", "quantile"), source=SIDECAR,
)
NODE_LAST_STEP_TIMESTAMP = _declare(
    "robust_node_last_step_timestamp_seconds", S,
    "Over the node's ranks: the latest robust_last_step_timestamp_seconds (quantile 1).",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR, unit="seconds",
)
NODE_LAST_CHECKPOINT_TIMESTAMP = _declare(
    "robust_node_last_checkpoint_timestamp_seconds", S,
    "Over the node's ranks: the latest robust_last_checkpoint_timestamp_seconds (quantile 1).",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR, unit="seconds",
)
NODE_LOSS = _declare(
    "robust_node_loss", S,
    "Over the node's ranks with a finite robust_loss: its sum (_sum) and their number (_count).",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
NODE_NONFINITE_GRAD = _declare(
    "robust_node_nonfinite_grad_steps", S,
    "Over the node's ranks: the most steps with a non-finite gradient norm any of them counted "
    "(robust_nonfinite_grad_steps_total, quantile 1). After the all-reduce every rank sees them.",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
NODE_SKIPPED_STEPS = _declare(
    "robust_node_skipped_steps", S,
    "Over the node's ranks that step through a GradScaler: the sum of their "
    "robust_skipped_steps_total (_sum), against robust_node_steps_sum of the same node.",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
NODE_GRAD_NORM = _declare(
    "robust_node_grad_norm", S,
    "Over the node's ranks with a finite robust_grad_norm: the greatest (quantile 1).",
    labels=NODE_PROGRESS_LABELS, source=SIDECAR,
)
RANK_STEP_AGE = _declare(
    "robust_rank_step_age_seconds", G,
    "Seconds since the rank last completed a step (or returned to training), so a rank stuck in "
    "a collective or stopped shows its age growing: from the sidecar as of the rank's last write "
    "of its files while it writes them, then on the sidecar's clock (counting from watch() "
    "before the first step); from a rank scraped in-process (http, otel), on the rank's clock "
    "at the scrape, once it has stepped.", source=SIDECAR, unit="seconds",
)
RANK_GPU_INFO = _declare(
    "robust_rank_gpu_info", G, "Always 1; which GPU a rank's process uses.",
    labels=("run", "rank", "node", "gpu", "uuid"), source=SIDECAR,
)
NVML_UP = _declare(
    "robust_nvml_up", G, "1 when NVML initialised (driver present), 0 otherwise.", labels=NODE,
    source=SIDECAR,
)
GPU_INFO = _declare(
    "robust_gpu_info", G, "Always 1; identity of a GPU.", labels=(*GPU, "uuid", "name"),
    source=SIDECAR,
)
GPU_PEAK_FLOPS = _declare(
    "robust_gpu_peak_flops", G,
    "Peak dense FLOP/s of a GPU in the sidecar's --gpu-peak-dtype (default bf16), from its NVML "
    "name (robust_metrics/sidecar/gpu_peaks.py) or --gpu-peak-flops; the MFU denominator.",
    labels=GPU, source=SIDECAR,
)
RANK_GPU_PEAK_FLOPS = _declare(
    "robust_rank_gpu_peak_flops", G,
    "Peak dense FLOP/s of the GPU a rank runs on (the GPU NVML sees its process on, else the GPU "
    "numbered as its local rank), for ranks that count model FLOPs; the MFU denominator per rank.",
    source=SIDECAR, default_on=False,
)
GPU_LOST = _declare(
    "robust_gpu_lost", G,
    "1 when NVML reports the GPU lost or inaccessible (fallen off the bus), 0 otherwise.",
    labels=GPU, source=SIDECAR,
)
GPU_UTILIZATION = _declare(
    "robust_gpu_utilization_ratio", G, "Fraction of time a kernel ran on the GPU (0-1).",
    labels=GPU, source=SIDECAR,
)
GPU_MEMORY_USED = _declare(
    "robust_gpu_memory_used_bytes", G, "GPU memory in use.", labels=GPU, source=SIDECAR,
    unit="bytes",
)
GPU_MEMORY_TOTAL = _declare(
    "robust_gpu_memory_total_bytes", G, "GPU memory in total.", labels=GPU, source=SIDECAR,
    unit="bytes",
)
GPU_TEMPERATURE = _declare(
    "robust_gpu_temperature_celsius", G, "GPU core temperature.", labels=GPU, source=SIDECAR,
    unit="celsius",
)
GPU_POWER = _declare(
    "robust_gpu_power_watts", G, "GPU power draw.", labels=GPU, source=SIDECAR, unit="watts",
)
GPU_ENERGY = _declare(
    "robust_gpu_energy_joules_total", C, "GPU energy consumed since the driver loaded.",
    labels=GPU, source=SIDECAR, unit="joules",
)
GPU_SM_CLOCK = _declare(
    "robust_gpu_sm_clock_hertz", G, "SM clock.", labels=GPU, source=SIDECAR, unit="hertz",
)
GPU_MEMORY_CLOCK = _declare(
    "robust_gpu_memory_clock_hertz", G, "Memory clock.", labels=GPU, source=SIDECAR,
    unit="hertz",
)
GPU_THROTTLE = _declare(
    "robust_gpu_clock_throttle", G,
    "1 when the named clock-throttle reason is active (hw_slowdown, sw_thermal, power_cap, ...).",
    labels=(*GPU, "reason"), source=SIDECAR,
)
GPU_ECC_ERRORS = _declare(
    "robust_gpu_ecc_errors_total", C,
    "ECC errors since the driver loaded, by type (corrected, uncorrected).",
    labels=(*GPU, "type"), source=SIDECAR,
)
GPU_ROW_REMAP_PENDING = _declare(
    "robust_gpu_row_remap_pending", G, "1 when a row remap is pending (needs a GPU reset).",
    labels=GPU, source=SIDECAR,
)
GPU_ROW_REMAP_FAILURE = _declare(
    "robust_gpu_row_remap_failure", G, "1 when a row remap failed (the GPU needs replacing).",
    labels=GPU, source=SIDECAR,
)
GPU_PCIE_REPLAYS = _declare(
    "robust_gpu_pcie_replays_total", C, "PCIe replay events.", labels=GPU, source=SIDECAR,
)
GPU_NVLINK_ERRORS = _declare(
    "robust_gpu_nvlink_errors_total", C, "NVLink errors by link and type (crc, replay, recovery).",
    labels=(*GPU, "link", "type"), source=SIDECAR,
)
GPU_XID_ERRORS = _declare(
    "robust_gpu_xid_errors_total", C, "XID events seen by the sidecar, by XID code.",
    labels=(*GPU, "xid"), source=SIDECAR,
)
NIC_PORT_UP = _declare(
    "robust_nic_port_up", G, "1 when the InfiniBand/RoCE port state is ACTIVE.",
    labels=NIC_PORT, source=SIDECAR,
)
NIC_PORT_RATE = _declare(
    "robust_nic_port_rate_bytes", G, "Link rate of the port in bytes per second.",
    labels=NIC_PORT, source=SIDECAR, unit="bytes",
)
NIC_TRANSMIT = _declare(
    "robust_nic_transmit_bytes_total", C, "Bytes sent by the port.", labels=NIC_PORT,
    source=SIDECAR, unit="bytes",
)
NIC_RECEIVE = _declare(
    "robust_nic_receive_bytes_total", C, "Bytes received by the port.", labels=NIC_PORT,
    source=SIDECAR, unit="bytes",
)
NIC_ERRORS = _declare(
    "robust_nic_port_errors_total", C,
    "Port error counters by name (symbol_error, link_downed, port_rcv_errors, ...).",
    labels=(*NIC_PORT, "counter"), source=SIDECAR,
)
NETDEV_CARRIER_CHANGES = _declare(
    "robust_netdev_carrier_changes_total", C, "Carrier changes (link flaps) of a network device.",
    labels=("node", "interface"), source=SIDECAR,
)
NETDEV_UP = _declare(
    "robust_netdev_up", G, "1 when the network device has carrier.",
    labels=("node", "interface"), source=SIDECAR,
)
NCCL_RAS_UP = _declare(
    "robust_nccl_ras_up", G, "1 when NCCL's RAS service answered the last query.", labels=NODE,
    source=SIDECAR,
)
NCCL_COMMUNICATORS = _declare(
    "robust_nccl_communicators", G, "NCCL communicators known to the RAS service.", labels=NODE,
    source=SIDECAR,
)
NCCL_MISSING_RANKS = _declare(
    "robust_nccl_missing_ranks", G,
    "Ranks the RAS service reports missing or unresponsive.", labels=NODE, source=SIDECAR,
)
NCCL_ERRORS = _declare(
    "robust_nccl_errors", G, "Errors the RAS service reports in its last report.", labels=NODE,
    source=SIDECAR,
)

# --- sidecar: node self-test (robust_metrics/selftest, POST /control/selftest) --------------
SELFTEST_PASSED = _declare(
    "robust_selftest_passed", G,
    "1 when the check passed in the node's last self-test, 0 when it failed; absent for a check "
    "that was skipped (no GPU, no torch) or has not run.",
    labels=("node", "check"), source=SIDECAR, on_event=True,
)
SELFTEST_DURATION = _declare(
    "robust_selftest_duration_seconds", G,
    "Time each check of the node's last self-test took.",
    labels=("node", "check"), source=SIDECAR, unit="seconds", on_event=True,
)
SELFTEST_LAST_RUN = _declare(
    "robust_selftest_last_run_timestamp_seconds", G,
    "Unix time at which the node's last self-test started.",
    labels=NODE, source=SIDECAR, unit="seconds", on_event=True,
)
SELFTEST_COMPUTE_FLOPS = _declare(
    "robust_selftest_compute_flops", G,
    "Float32 matrix-multiply throughput (FLOP/s) of the last compute check; compared with the "
    "node's own history and the fleet median.",
    labels=NODE, source=SIDECAR, unit="flops", on_event=True,
)
SELFTEST_MEMORY_BYTES = _declare(
    "robust_selftest_memory_verified_bytes", G,
    "Bytes written and read back with every pattern by the last memory check.",
    labels=NODE, source=SIDECAR, unit="bytes", on_event=True,
)
SELFTEST_BUS_BANDWIDTH = _declare(
    "robust_selftest_bus_bandwidth_bytes_per_second", G,
    "All-reduce bus bandwidth (algorithm bandwidth x 2(n-1)/n, as nccl-tests reports it) of the "
    "last communication check.",
    labels=NODE, source=SIDECAR, unit="bytes_per_second", on_event=True,
)
SELFTEST_GPU_PROBLEMS = _declare(
    "robust_selftest_gpu_problems", G,
    "Problems the last gpu check found through NVML (XID events, uncorrected ECC errors, row "
    "remaps pending or failed, hardware throttling, lost GPUs).",
    labels=NODE, source=SIDECAR, on_event=True,
)

# --- bridge (robust_metrics/bridge) ---------------------------------------------------------
BRIDGE = Source.BRIDGE
BRIDGE_WEBHOOKS = _declare(
    "robust_bridge_webhook_requests_total", C, "Webhook requests received, by HTTP status.",
    labels=("status",), source=BRIDGE,
)
BRIDGE_ACTIONS = _declare(
    "robust_bridge_actions_total", C,
    "Actions the bridge took, by run, action and result (success, failed, skipped, dry_run).",
    labels=("run", "action", "result"), source=BRIDGE,
)
BRIDGE_ACTION_DURATION = _declare(
    "robust_bridge_action_duration_seconds", H, "Duration of bridge actions.",
    labels=("action",), source=BRIDGE, unit="seconds",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
RUN_STOP_TIMESTAMP = _declare(
    "robust_bridge_run_stop_timestamp_seconds", G,
    "When the bridge last began stopping the run (a restart), set before it asks the scheduler: "
    "rank exits from then on were requested, not crashes.",
    labels=("run",), source=BRIDGE, unit="seconds",
)
RUN_STOP_END_TIMESTAMP = _declare(
    "robust_bridge_run_stop_end_timestamp_seconds", G,
    "When the bridge's last stop of the run ended (the scheduler's restart returned): exits after "
    "it are the new processes' own again.",
    labels=("run",), source=BRIDGE, unit="seconds",
)
HANG_SUSPECT = _declare(
    "robust_hang_suspect", G,
    "1 for a rank that stack aggregation names as the outlier of a hung run.",
    labels=("run", "rank", "node"), source=BRIDGE,
)

INCIDENT_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
INCIDENT_DETECT = _declare(
    "robust_bridge_incident_detect_seconds", H,
    "Incident ledger: seconds from the fault (a hang: the run's last step; otherwise the alert's "
    "startsAt) to the bridge receiving the alert.",
    labels=("alertname",), source=BRIDGE, unit="seconds", buckets=INCIDENT_BUCKETS,
)
INCIDENT_ACT = _declare(
    "robust_bridge_incident_act_seconds", H,
    "Incident ledger: seconds from the bridge receiving the alert to the end of its remedial "
    "action (restart or drain_node).",
    labels=("alertname",), source=BRIDGE, unit="seconds", buckets=INCIDENT_BUCKETS,
)
INCIDENT_RECOVER = _declare(
    "robust_bridge_incident_recover_seconds", H,
    "Incident ledger: seconds from the end of the remedial action to the run's first step after "
    "it, as Prometheus scraped it.",
    labels=("alertname",), source=BRIDGE, unit="seconds", buckets=INCIDENT_BUCKETS,
)
INCIDENT_LOST_STEPS = _declare(
    "robust_bridge_incident_lost_steps_total", C,
    "Incident ledger: steps redone after resuming from a checkpoint (highest step before the "
    "action minus the step the run resumed from), by alert.",
    labels=("alertname",), source=BRIDGE,
)
INCIDENTS = _declare(
    "robust_bridge_incidents_total", C,
    "Incident ledger: incidents entered, by alert and outcome (recovered, crash_loop, "
    "not_recovered, no_restart).",
    labels=("alertname", "outcome"), source=BRIDGE,
)
NODE_INCIDENTS = _declare(
    "robust_bridge_node_incidents", G,
    "Suspect-node score: incidents that named the node (hang culprit, slow rank, XID, ECC, NIC "
    "flap, ...) within the bridge's node window, across runs.",
    labels=("node",), source=BRIDGE,
)

del C, G, S, H, SIDECAR, BRIDGE


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
    """The metric reference table of docs/metrics.md (robust_metrics/references.py)."""
    rows = [
        "| metric | type | labels | source | help |",
        "|---|---|---|---|---|",
    ]
    for m in _REGISTRY.values():
        labels = ", ".join(f"`{label}`" for label in m.labels)
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {m.source} | {m.help} |")
    return "\n".join(rows) + "\n"
