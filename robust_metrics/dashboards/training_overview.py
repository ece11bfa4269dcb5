"""The "Training overview" dashboard: is the run making progress, how fast, and is it healthy."""

from __future__ import annotations

from robust_metrics.dashboards.model import DashboardSpec, Needs, PanelSpec, Section, Target
from robust_metrics.dashboards.queries import (
    ALERTS,
    ETTR_1H,
    ETTR_START,
    MFU,
    RANK_FLOPS,
    RANKS,
    RUN,
    STEP_TIME_MAX,
    STEP_TIME_MEDIAN,
    THROUGHPUT,
    increase,
)
from robust_metrics.dashboards.styles import (
    ETTR_COLOURS,
    ZERO_GOOD,
    bars,
    hide_time,
    log_scale,
    points,
    stacked,
    thresholds,
)

TRAINING_OVERVIEW = DashboardSpec(
    uid="robust-training-overview",
    file="training-overview.json",
    title="Training overview",
    description="Is the run making progress, how fast, and is it numerically healthy.",
    annotations=(ALERTS,),
    sections=(
        Section("Goodput", (
            PanelSpec("ETTR (1 h)", "stat", (Target(ETTR_1H, "{{run}}", True),),
                      "Effective training time ratio over the last hour: time spent in productive "
                      "training steps over wall time. Below 0.9 the run loses more than 6 min an "
                      "hour to hangs, restarts, checkpoints or slow steps.",
                      unit="percentunit", width=4, height=5, style=ETTR_COLOURS),
            PanelSpec("ETTR (since start)", "stat",
                      (Target(ETTR_START, "{{run}}", True),),
                      "Effective training time ratio since the run started (restarts included).",
                      unit="percentunit", width=4, height=5, style=ETTR_COLOURS),
            PanelSpec("Throughput", "stat", (Target(THROUGHPUT, "{{run}}", True),),
                      "Optimizer steps per second of the run (over the last minute).",
                      unit="none", width=4, height=5),
            PanelSpec("Global step", "stat",
                      (Target(f"max by (run) (robust_global_step{{{RUN}}})", "{{run}}", True),),
                      "Training step counter, including steps restored from a checkpoint.",
                      unit="none", width=4, height=5),
            PanelSpec("Time since last checkpoint", "stat",
                      (Target(f"time() - max by (run) "
                              f"(robust_last_checkpoint_timestamp_seconds{{{RUN}}} > 0)",
                              "{{run}}", True),),
                      "Seconds since the newest successful checkpoint of any rank: the work a "
                      "crash would throw away now. Empty until the first checkpoint.",
                      unit="s", width=4, height=5, needs=Needs.CHECKPOINT,
                      style=thresholds((None, "green"), (3600, "orange"), (7200, "red"))),
            PanelSpec("Restarts", "stat",
                      (Target(f"sum by (run) (resets(robust_steps_total{{{RUN}}}[$__range]))",
                              "{{run}}", True),),
                      "Rank process restarts in the dashboard's time range (resets of the "
                      "per-process step counter, summed over ranks).",
                      unit="none", width=4, height=5, style=ZERO_GOOD),
        )),
        Section("Speed", (
            PanelSpec("Step time (median and max across ranks)", "timeseries", (
                Target(STEP_TIME_MEDIAN, "median {{run}}"),
                Target(STEP_TIME_MAX, "max {{run}}"),
            ), "Mean step time per rank over the rate window, as the median and the maximum "
               "across the run's ranks. A gap between the two is a straggler; both rising "
               "together is the whole job slowing down.", unit="s"),
            PanelSpec("Throughput over time", "timeseries",
                      (Target(THROUGHPUT, "{{run}}"),),
                      "Optimizer steps per second of the run.", unit="none"),
            PanelSpec("Model FLOPs utilisation (MFU)", "timeseries", (Target(MFU, "{{run}}"),),
                      "Achieved model FLOP/s (watch(flops_per_step=...)) over the summed peak "
                      "FLOP/s of the ranks' GPUs (the sidecar's table, --gpu-peak-dtype). MFUDrop "
                      "fires when it stays 10% below its last-hour median for 10 minutes.",
                      unit="percentunit"),
            PanelSpec("Achieved FLOP/s per rank", "timeseries",
                      (Target(RANK_FLOPS, "rank {{rank}}"),),
                      "Model FLOP/s each rank computes. A rank below its peers computes less "
                      "per second: a straggler or a throttled GPU.", unit="flops"),
        )),
        Section("Numerics", (
            PanelSpec("Loss", "timeseries", (
                Target(f"robust_loss{{{RANKS}}}", "rank {{rank}}"),
                Target(f"avg_over_time(run:robust_loss:mean{{{RUN}}}[5m])", "5 min mean {{run}}"),
            ), "Loss of each rank's last step, with every sample drawn so a one-step spike "
               "shows, against the run's 5 minute mean (of finite values: one NaN does not "
               "blank the baseline).",
               width=8, style=points),
            PanelSpec("Gradient norm", "timeseries",
                      (Target(f"robust_grad_norm{{{RANKS}}}", "rank {{rank}}"),),
                      "Total L2 norm of the gradients (log scale): spikes precede loss spikes "
                      "and divergence.", width=8, style=log_scale),
            PanelSpec("Non-finite steps", "timeseries", (
                Target(f"sum by (run) {increase(f'robust_nonfinite_loss_steps_total{{{RANKS}}}')}",
                       "loss {{run}}"),
                Target(f"sum by (run) {increase(f'robust_nonfinite_grad_steps_total{{{RANKS}}}')}",
                       "gradient {{run}}"),
            ), "Steps whose loss or gradient norm was NaN or infinite. Zero in a healthy run.",
               width=8, needs=Needs.NONFINITE, style=bars),
        )),
        Section("Alerts and phases", (
            PanelSpec("Active alerts", "table",
                      (Target(f'ALERTS{{alertstate="firing", {RUN}}}', "", True),),
                      "Alerts firing now for the selected runs (Prometheus ALERTS series).",
                      width=12, needs=Needs.ALERT, style=hide_time),
            PanelSpec("Ranks per phase", "timeseries",
                      (Target(f"sum by (run, phase) (robust_phase{{{RUN}}})", "{{phase}} {{run}}"),),
                      "How many ranks are training, evaluating or checkpointing. Hang and slowness "
                      "alerts stay silent outside `train`.", width=6, style=stacked),
            PanelSpec("Hook errors", "timeseries",
                      (Target(f"sum by (run, where) {increase(f'robust_hook_errors_total{{{RUN}}}')}",
                              "{{where}} {{run}}"),),
                      "Exceptions the hook caught (training went on). Any value here means a "
                      "metric may be missing or wrong.", width=6, needs=Needs.HOOK_ERROR, style=bars),
        )),
    ),
)
