"""Rule evaluation cost at scale: a real Prometheus, or VictoriaMetrics with vmagent shards and
vmalert, scraping a synthetic 16,384-rank job.

    .venv/bin/python bench/rules_scale.py [--ranks 16384] [--duration 180] [--interval 15s]
        [--engine prometheus|victoriametrics|both] [--shards 2] [--cpu-profile FILE]
        [--rule-file PATH]
    .venv/bin/python bench/rules_scale.py --score-placements RESULT.json

A synthetic exporter serves, for every rank, the series the hook publishes in-process (every rank
metric of the schema, one op/group for the collective metrics, three phases) plus the per-rank
series of the node sidecar (liveness, CPU, memory, step age, GPU mapping) and, per node of 8
ranks, the sidecar's summaries of its ranks' step windows (computed by the sidecar's own
`node_summaries.summarise`), split over one scrape target per 512 ranks (a node sidecar serves 8;
the split only changes scrape parallelism). The rules are rendered for that deployment
(`--node-summaries sidecar`) unless told otherwise. Rank 7
computes 50% longer than the others so the straggler rules have something to find. Prometheus
evaluates the shipped rules at production intervals (15 s), and the benchmark reports each rule
group's evaluation time (`evaluationTime` of /api/v1/rules, the value of
`prometheus_rule_group_last_duration_seconds`), series per rank, and Prometheus' memory; then
each group's cost alone (a quiet replay of its expressions), and a timeline that sets every
evaluation beside the evaluations and scrapes that ran with it and the CPU Prometheus used.

Prometheus 2.42 starts each group at a fixed offset in the interval, hashed from the group's name
and the rule file's path, so the path decides which groups evaluate side by side. By default the
rules go to a new temporary path each run (a new placement each time); `--rule-file PATH` writes
them where a deployment loads them from, so that the run measures that deployment's placement and
repeats it. `--score-placements RESULT.json` starts nothing: it predicts the placement of the
groups for candidate paths and names the best, median and worst of them (a model of the round
with the group costs of an earlier run).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from robust_metrics import rule_shards, rules, schema
from robust_metrics.hooks.windows import PUBLISHED
from robust_metrics.processes import (
    Prometheus,
    QueryAPI,
    ServiceError,
    VictoriaMetrics,
    VMAgent,
    VMAlert,
    alertmanager,
    free_port,
)
from robust_metrics.sidecar.collectors.node_summaries import (
    PROCESS_SUMMARIES,
    SUMMARIES,
    SUMMARISED_ONLY,
    RankValue,
    summarise,
)
from robust_metrics.sidecar.collectors.nvml import THROTTLE_REASONS

SLOW_RANK = 7
SLOW_RANKS = ('max without (window) (robust_step_compute_mean_seconds{window="5m"} / on (run) '
              "group_left () run:robust_step_compute_seconds:median5m > 1.25)")
RUN = "bench"
# Alerts the synthetic job raises: SlowRank for rank 7 and StragglerSlowdownHigh for the run.
# Anything else means the synthetic job is not the healthy one the figures are meant for (one
# alert per rank costs more to evaluate than every rule together).
ALERTS_BY_NAME = "count by (alertname, alertstate) (ALERTS)"

# value key of each sample name; %(key)s placeholders are filled once per scrape
SAMPLE_KEYS = {
    "robust_steps_total": "steps", "robust_last_step_timestamp_seconds": "now",
    "robust_global_step": "steps", "robust_step_duration_seconds_sum": "steps",
    "robust_step_duration_seconds_count": "steps", "robust_step_compute_seconds_sum": "compute",
    "robust_step_compute_seconds_count": "steps", "robust_data_wait_seconds_sum": "small",
    "robust_data_wait_seconds_count": "steps", "robust_gc_pause_seconds_sum": "small",
    "robust_gc_pause_seconds_count": "steps", "robust_loss": "loss", "robust_grad_norm": "one",
    "robust_collective_duration_seconds_sum": "blocked",
    "robust_collective_duration_seconds_count": "steps",
    "robust_collective_bytes_total": "bytes", "robust_collectives_entered_total": "steps",
    "robust_collectives_completed_total": "steps", "robust_rank_step_age_seconds": "small",
    "robust_rank_process_cpu_seconds_total": "steps", "robust_last_checkpoint_timestamp_seconds":
    "start", "robust_rank_process_resident_memory_bytes": "bytes",
    "robust_model_flops_total": "flops", "robust_gpu_peak_flops": "peak",
    "robust_rank_gpu_peak_flops": "peak",
    # the hook's step windows (hooks/windows.py): every window of a steady rank the same
    "robust_step_compute_mean_seconds": "compute_mean",
    "robust_step_duration_mean_seconds": "duration_mean",
    "robust_step_compute_variation_ratio": "variation", "robust_window_steps": "window_steps",
    # a healthy rank: no non-finite step, no failed or requested checkpoint, started at step 0
    "robust_nonfinite_loss_steps_total": "zero", "robust_nonfinite_grad_steps_total": "zero",
    "robust_checkpoint_failures_total": "zero", "robust_checkpoint_request_id": "zero",
    "robust_start_step": "zero",
    # a healthy GPU (--gpu-series): not lost, not throttled, no ECC error, no row to remap
    "robust_gpu_lost": "zero", "robust_gpu_clock_throttle": "zero",
    "robust_gpu_ecc_errors_total": "zero", "robust_gpu_row_remap_pending": "zero",
    "robust_gpu_row_remap_failure": "zero", "robust_gpu_pcie_replays_total": "zero",
    "robust_gpu_energy_joules_total": "steps",
}
# values of the labels a series has several of (one series per value); `window`: by metric,
# the windows the hook publishes of it that the sidecar serves (it summarises the others)
MULTI_VALUED: dict[str, tuple[str, ...] | dict[str, tuple[str, ...]]] = {
    "phase": schema.PHASES, "reason": tuple(THROTTLE_REASONS),
    "type": ("corrected", "uncorrected"),
    "window": {spec.name: tuple(w for w in windows if (spec.name, w) not in SUMMARISED_ONLY)
               for spec, windows in PUBLISHED}}
FLOPS_PER_SECOND, PEAK_FLOPS = 400e12, 989e12  # with --flops: MFU = 400 / 989 on every rank


def _labels(spec: schema.MetricSpec, rank: int, node: int) -> list[str]:
    """Label sets of one rank's series of `spec` (one op/group, three phases; for a GPU, every
    throttle reason and both ECC error types, every published window)."""
    values = {"run": RUN, "rank": str(rank), "op": "all_reduce", "group": "default_pg",
              "node": f"node{node}", "gpu": str(rank % 8), "uuid": f"GPU-{rank}",
              "name": "NVIDIA H100 80GB HBM3", "local_rank": str(rank % 8),
              "world_size": "16384", "pid": str(10000 + rank), "dp_rank": str(rank),
              "pp_rank": "0", "tp_rank": "0"}
    sets = [""]
    for name in spec.labels:
        multi = MULTI_VALUED.get(name)
        choices = (values[name],) if multi is None else (
            multi[spec.name] if isinstance(multi, dict) else multi)
        sets = [f'{head},{name}="{v}"' if head else f'{name}="{v}"'
                for head in sets for v in choices]
    return sets


def gpu_specs() -> list[schema.MetricSpec]:
    """Per-GPU series the sidecar publishes for a healthy GPU (NVML), but its NVLink error
    counters (4 per active link: 72 for an H100's 18 links) and the peak (--flops)."""
    return [m for m in schema.all_metrics()
            if m.source is schema.Source.SIDECAR and "gpu" in m.labels and "rank" not in m.labels
            and m.default_on and not m.on_event and m not in (
                schema.GPU_NVLINK_ERRORS, schema.GPU_XID_ERRORS, schema.GPU_PEAK_FLOPS)]


def rank_specs(flops: bool = False, gpu_series: bool = False) -> list[schema.MetricSpec]:
    """Per-rank metrics a healthy CPU rank publishes by default (no CUDA memory, no hook errors,
    nothing that appears only after an event: a spike, a stop, an exit, a normal end);
    with `flops`, also the FLOP counter of watch(flops_per_step=), the peak of the rank's GPU
    (one GPU per rank, so the sidecar's per-GPU peak counts here as one series per rank) and the
    same peak as the sidecar publishes it for the rank."""
    if gpu_series:
        return [*rank_specs(flops), *gpu_specs()]
    if flops:
        return [*rank_specs(), schema.MODEL_FLOPS, schema.GPU_PEAK_FLOPS,
                schema.RANK_GPU_PEAK_FLOPS]
    skip = {"robust_cuda_memory_allocated_bytes", "robust_cuda_memory_reserved_bytes",
            "robust_cuda_memory_peak_bytes", "robust_hook_errors_total"}
    return [m for m in schema.all_metrics()
            if m.default_on and not m.on_event and m.name not in skip and "rank" in m.labels
            and m.source in (schema.Source.RANK, schema.Source.SIDECAR)]


# the window values of a steady rank (Exporter.values) and of rank 7; the steps of the last
# minute grow for the first minute, so they stay a placeholder
RANK_WINDOWS = {"robust_step_compute_mean_seconds": (0.6, 0.9),
                "robust_step_duration_mean_seconds": (1.0, 1.0),
                "robust_step_compute_variation_ratio": (0.03 / 0.6, 0.03 / 0.9)}
STEPS_PLACEHOLDER = -1.0


def node_summary_lines(ranks: Sequence[int], node: int) -> list[str]:
    """What the node's sidecar publishes of its ranks' windows (node_summaries.summarise, the
    sidecar's own code, on the values the ranks serve) and of their progress."""
    windows = [RankValue(RUN, str(rank), metric, window, values[rank == SLOW_RANK])
               for rank in ranks for spec, names in PUBLISHED for window in names
               for metric, values in RANK_WINDOWS.items() if metric == spec.name]
    windows += [RankValue(RUN, str(rank), schema.WINDOW_STEPS.name, "1m", STEPS_PLACEHOLDER)
                for rank in ranks]
    lines = []
    for family in summarise(windows, f"node{node}", {}):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            value = ("%(window_steps)s" if sample.value == STEPS_PLACEHOLDER
                     else f"{sample.value:.6g}")
            lines.append(f"{sample.name}{{{labels}}} {value}")
    return lines + progress_summary_lines(len(ranks), node)


def progress_summary_lines(ranks: int, node: int) -> list[str]:
    """The node's summaries of its ranks' progress. Every synthetic rank steps alike, so a
    quantile is any rank's value and a sum `ranks` times it (keys `KEY_times_N` of
    Exporter.values)."""
    lines = []
    for summary in (*SUMMARIES, *PROCESS_SUMMARIES):
        if summary.key == "window":
            continue
        for key in ((summary.values or schema.PHASES) if summary.key == "phase" else ("",)):
            labels = f'run="{RUN}",node="node{node}"' + (f',phase="{key}"' if key else "")
            value = ("one" if key == "train" else "zero") if key else SAMPLE_KEYS.get(
                summary.source, "one")
            name = summary.spec.name
            for statistic in summary.statistics:
                if statistic == "count":
                    lines.append(f"{name}_count{{{labels}}} {ranks}")
                elif statistic == "sum":
                    lines.append(f"{name}_sum{{{labels}}} %({value}_times_{ranks})s")
                else:
                    lines.append(f'{name}{{{labels},quantile="{statistic}"}} %({value})s')
    return lines


def shard_template(ranks: range, flops: bool = False, gpu_series: bool = False) -> str:
    lines = []
    specs = rank_specs(flops, gpu_series)
    for rank in ranks:
        node = rank // 8
        if rank % 8 == 0:
            lines.extend(node_summary_lines(range(rank, min(rank + 8, ranks.stop)), node))
        for spec in specs:
            for labels in _labels(spec, rank, node):
                for sample in spec.sample_names():
                    key = SAMPLE_KEYS.get(sample, "one")
                    if rank == SLOW_RANK and key in ("compute", "compute_mean", "variation", "blocked"):
                        key += "_slow"
                    if sample == "robust_phase":
                        key = "one" if labels.endswith('"train"') else "zero"
                    lines.append(f"{sample}{{{labels}}} %({key})s")
    return "\n".join(lines).replace("%(", "\0").replace("%", "%%").replace("\0", "%(") + "\n"


class Exporter:
    """Serves /shard/<i> for every shard; values advance with wall time (1 step per second)."""

    def __init__(self, ranks: int, per_target: int, flops: bool = False,
                 gpu_series: bool = False) -> None:
        self.templates = [shard_template(range(i, min(i + per_target, ranks)), flops, gpu_series)
                          for i in range(0, ranks, per_target)]
        self.series = sum(t.count("\n") for t in self.templates)
        self.start = time.time()
        self.port = free_port()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    shard = int(self.path.rsplit("/", 1)[1])
                    body = (exporter.templates[shard] % exporter.values()).encode()
                except (ValueError, IndexError):
                    self.send_error(404, "no such shard")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def values(self) -> dict[str, str]:
        values = self._values()
        for n in range(1, 9):  # a node's sums (progress_summary_lines)
            for key in ("steps", "loss", "one"):
                values[f"{key}_times_{n}"] = f"{n * float(values[key]):.3f}"
        return values

    def _values(self) -> dict[str, str]:
        now = time.time()
        t = now - self.start
        return {"steps": f"{t:.3f}", "now": f"{now:.3f}", "start": f"{self.start:.3f}",
                "compute": f"{0.6 * t:.3f}", "compute_slow": f"{0.9 * t:.3f}",
                # the hook's windows of 1 s steps of 0.6 s (0.9 s) compute with a 0.03 s
                # step-to-step spread: as many steps as seconds, up to the minute
                "compute_mean": "0.6", "compute_mean_slow": "0.9", "duration_mean": "1.0",
                "variation": f"{0.03 / 0.6:.4f}", "variation_slow": f"{0.03 / 0.9:.4f}",
                "window_steps": f"{min(int(t), 60)}",
                "blocked": f"{0.4 * t:.3f}", "blocked_slow": f"{0.1 * t:.3f}",
                "small": f"{0.01 * t:.3f}", "loss": "2.0", "one": "1", "zero": "0",
                "bytes": f"{1e6 * t:.0f}", "flops": f"{FLOPS_PER_SECOND * t:.6e}",
                "peak": f"{PEAK_FLOPS:.6e}"}

    def __enter__(self) -> Exporter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


BASELINE = {"name": "bench-baseline", "rules": [
    {"record": "bench:robust_global_step:count", "expr": "count(robust_global_step)"},
    {"record": "bench:robust_steps:rate5m_sum", "expr": "sum(rate(robust_steps_total[5m]))"}]}


def _group_table(durations: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per group: evaluations, median and max seconds, and the median over the baseline's.
    The shards of a group (`<group>-ranks-<k>`) also get one row, `<group>-ranks-*`, holding
    the slowest shard's figures: shards run in parallel, so that is what the group waits for."""
    base = statistics.median(durations.get("bench-baseline", [0.0])) or float("nan")
    table = {name: {"evaluations": len(v), "median_s": round(statistics.median(v), 4),
                    "max_s": round(max(v), 4),
                    "median_x_baseline": round(statistics.median(v) / base, 1)}
             for name, v in sorted(durations.items()) if v}
    for name, row in list(table.items()):
        source, _, shard = name.rpartition("-ranks-")
        if source and shard.isdigit():
            slowest = table.setdefault(f"{source}-ranks-*", dict(row))
            if row["median_s"] >= slowest["median_s"]:
                table[f"{source}-ranks-*"] = dict(row)
    return table


def measure_prometheus(args: argparse.Namespace, exporter: Exporter, rule_file: Path,
                       scrape: list[dict[str, object]], tmp: Path) -> dict[str, object]:
    """Prometheus scraping every target and evaluating the rules; then a quiet replay."""
    prom = Prometheus(tmp / "prom", [], rule_files=[rule_file],
                            scrape_interval=args.interval, evaluation_interval=args.interval,
                            extra_scrape_configs=scrape)
    with prom:
        durations: dict[str, list[float]] = {}
        seen: set[tuple[str, str]] = set()
        timeline = Timeline(prom)
        start = _metrics(prom.url)
        appended = _sum(start, "prometheus_tsdb_head_samples_appended_total")
        cpu = _sum(start, "process_cpu_seconds_total")
        machine = psutil.cpu_times()
        t0 = time.monotonic()
        deadline = time.monotonic() + args.duration
        profiler = CpuProfile(prom.url, args.cpu_profile, min(60.0, args.duration))
        with timeline, profiler:
            while time.monotonic() < deadline:
                time.sleep(1)
                for group in prom.api("rules")["groups"]:
                    key = (group["name"], group["lastEvaluation"])
                    if group["lastEvaluation"].startswith("0001") or key in seen:
                        continue
                    seen.add(key)
                    durations.setdefault(group["name"], []).append(group["evaluationTime"])
                    timeline.evaluations.append(Span(group["name"], _epoch(
                        group["lastEvaluation"]), group["evaluationTime"]))
                timeline.poll_scrapes()
        end, elapsed = _metrics(prom.url), time.monotonic() - t0
        appended = (_sum(end, "prometheus_tsdb_head_samples_appended_total") - appended) / elapsed
        # cores Prometheus kept busy (scrapes, ingestion, rules, compaction): at the machine's
        # core count, group times are mostly waiting for a core
        cpu = (_sum(end, "process_cpu_seconds_total") - cpu) / elapsed
        machine_end = psutil.cpu_times()
        # the Go runtime's garbage collector: cycles, and the time it stopped the world
        gc_cycles = (_sum(end, "go_gc_duration_seconds_count")
                     - _sum(start, "go_gc_duration_seconds_count")) / elapsed
        gc_pause = (_sum(end, "go_gc_duration_seconds_sum")
                    - _sum(start, "go_gc_duration_seconds_sum")) / elapsed
        machine_busy = _busy_seconds(machine_end, machine) / elapsed
        steal = getattr(machine_end, "steal", 0.0) - getattr(machine, "steal", 0.0)
        slowest = sorted(((r["evaluationTime"], r["name"])
                          for g in prom.api("rules")["groups"] for r in g["rules"]),
                         reverse=True)[:8]
        errors = [r["name"] for g in prom.api("rules")["groups"]
                  for r in g["rules"] if r.get("health") == "err"]
        # per-record counts are cheap; a count over every series is not at this size
        rank_records = [r["record"] for r in rules.recording_rules(rules.load_groups())
                        if r["record"].split(":")[0] in ("run_rank", "node_gpu")]
        recorded_rank = sum(float(v[0]["value"][1]) for v in
                            (prom.query(f"count({name})") for name in rank_records) if v)
        head = prom.api("status/tsdb")["headStats"]
        scrape_s = [float(r["value"][1]) for r in prom.query("scrape_duration_seconds")]
        slowdown = prom.query("run:robust_straggler_slowdown:ratio5m")
        mfu = prom.query("run:robust_mfu:ratio5m")
        slow = prom.query(SLOW_RANKS)
        alerts = _alert_counts(prom.query(ALERTS_BY_NAME))
        rss = psutil.Process(prom.proc.pid).memory_info().rss if prom.proc else 0
        # Quiet replay: stop the exporter (no more ingestion) and the rule groups (an empty
        # rule file, reloaded on SIGHUP), then run every rule's expression as an instant query
        # at a moment inside the data, in group order, and sum the engine's own timings per
        # group: what each group costs on an idle engine, which the groups' times in the run
        # (beside scrapes and each other, at offsets that differ from run to run) hide.
        t_query = time.time() - 2 * rules.parse_duration(args.interval) / 1000
        exporter.server.shutdown()
        _stop_rule_groups(prom, rule_file)
        time.sleep(3 * rules.parse_duration(args.interval) / 1000)
        quiet: dict[str, list[float]] = {}
        per_rule: dict[str, float] = {}
        for _ in range(args.quiet_replays):
            for group in [*args.groups, BASELINE]:
                total = 0.0
                for rule in group["rules"]:
                    data = prom.api("query", query=rule["expr"], time=t_query, stats="all")
                    took = float(data["stats"]["timings"]["execTotalTime"])
                    total += took
                    name = rule.get("record") or rule.get("alert")
                    per_rule[name] = min(per_rule.get(name, took), took)
                quiet.setdefault(group["name"], []).append(total)
    return {
        "recorded_rank_series_per_rank": recorded_rank / args.ranks,
        "head_series_total": head["numSeries"],
        "samples_appended_per_s": appended,
        "prometheus_cpu_cores": round(cpu, 2),
        "machine_cores": psutil.cpu_count(),
        # every process's, the exporter's and this script's included
        "machine_busy_cores": round(machine_busy, 2),
        # cores the hypervisor gave to others while this VM had work
        "machine_steal_cores": round(steal / elapsed, 2),
        "gc_cycles_per_s": round(gc_cycles, 3),
        "gc_pause_share": round(gc_pause, 5),
        "gogc": os.environ.get("GOGC", "Prometheus' default"),
        "prometheus_rss_gib": rss / 2**30,
        "scrape_duration_s_max": max(scrape_s, default=0.0),
        "rule_errors": errors,
        "straggler_slowdown": slowdown[0]["value"][1] if slowdown else None,
        "mfu": mfu[0]["value"][1] if mfu else None,
        "slow_ranks_found": [s["metric"]["rank"] for s in slow],
        "alerts": alerts,
        "slowest_rules_last_eval_s": [(name, round(t, 4)) for t, name in slowest],
        "quiet_slowest_rules_s": sorted(((round(t, 4), n) for n, t in per_rule.items()),
                                        reverse=True)[:8],
        "quiet_replay_s": {name: round(min(v), 4) for name, v in quiet.items()},
        "quiet_rules_s": {name: round(t, 4) for name, t in per_rule.items()},
        "groups": _group_table(durations),
        "timeline": timeline.report({name: min(v) for name, v in quiet.items()},
                                    rules.parse_duration(args.interval) / 1000),
        "cpu_profile": profiler.report(),
    }


# Where Prometheus' CPU goes, by the frames whose time includes their callees (pprof's "cum"):
# the rule groups' evaluations, the part of them spent finding and sorting the selected series,
# the garbage collector's background marking and the marking it makes allocating goroutines do,
# and the scrapes with their ingestion.
PROFILE_FRAMES = {
    "rule_groups": "rules.(*Group).Eval",
    "rule_series_selection": "tsdb.(*headIndexReader).SortedPostings",
    "gc_background_marking": "runtime.gcBgMarkWorker",
    "gc_assists": "runtime.gcAssistAlloc",
    "scrapes": "scrape.(*scrapeLoop).scrapeAndReport",
}


class CpuProfile:
    """A CPU profile of Prometheus (its /debug/pprof/profile) over the first seconds of the
    measured window, saved to a file; with Go's pprof on the PATH, the share of the CPU time in
    each of PROFILE_FRAMES."""

    def __init__(self, url: str, path: Path | None, seconds: float) -> None:
        self.url, self.path, self.seconds = url, path, max(1, int(seconds))
        self.error: str | None = None
        self._thread = threading.Thread(target=self._take, daemon=True)

    def __enter__(self) -> CpuProfile:
        if self.path:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.path:
            self._thread.join()

    def _take(self) -> None:
        assert self.path
        try:
            with urllib.request.urlopen(f"{self.url}/debug/pprof/profile?seconds={self.seconds}",
                                        timeout=self.seconds + 30) as response:
                self.path.write_bytes(response.read())
        except OSError as exc:
            self.error = str(exc)

    def report(self) -> dict[str, Any] | None:
        if not self.path:
            return None
        if self.error or not self.path.exists():
            return {"path": str(self.path), "error": self.error or "no profile"}
        out: dict[str, Any] = {"path": str(self.path), "seconds": self.seconds}
        go = shutil.which("go")
        if go:
            top = subprocess.run([go, "tool", "pprof", "-top", "-cum", "-nodefraction=0",
                                  "-nodecount=100000", str(self.path)],
                                 capture_output=True, text=True, timeout=120, check=False)
            out["share_of_cpu"] = profile_shares(top.stdout)
        return out


def profile_shares(top: str) -> dict[str, float]:
    """The cum% of each of PROFILE_FRAMES in the text of `go tool pprof -top -cum`."""
    shares: dict[str, float] = {}
    for line in top.splitlines():
        fields = line.split()
        if len(fields) < 6 or not fields[4].endswith("%"):
            continue
        for key, frame in PROFILE_FRAMES.items():
            if key not in shares and fields[5].endswith(frame):
                shares[key] = round(float(fields[4].rstrip("%")) / 100, 3)
    return shares


@dataclasses.dataclass(frozen=True)
class Span:
    """One group evaluation or one scrape: what, when it began (epoch seconds), how long."""
    name: str
    start: float
    seconds: float

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def overlap(self, other: Span) -> float:
        return max(0.0, min(self.end, other.end) - max(self.start, other.start))


def _epoch(rfc3339: str) -> float:
    """Prometheus' RFC 3339 time with nanoseconds, as epoch seconds (Python parses micros)."""
    match = re.fullmatch(r"([^.]+?)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    if not match:
        raise ValueError(f"not an RFC 3339 time: {rfc3339!r}")
    whole, frac, zone = match.groups()
    zone = "+00:00" if zone == "Z" else zone
    return datetime.datetime.fromisoformat(whole + zone).timestamp() + float(frac or 0)


class Timeline:
    """When each group evaluated and each target was scraped, and the CPU Prometheus used
    every 0.1 s: whether a group slow in the run was slow because other evaluations and
    scrapes ran beside it (the group's own cost is its time alone, the quiet replay's)."""

    def __init__(self, prom: Prometheus, period: float = 0.1) -> None:
        self.prom, self.period = prom, period
        self.evaluations: list[Span] = []
        self.scrapes: dict[tuple[str, str], Span] = {}
        self.cpu: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_cpu, daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample_cpu(self) -> None:
        process = psutil.Process(self.prom.proc.pid) if self.prom.proc else None
        while process and not self._stop.wait(self.period):
            times = process.cpu_times()
            self.cpu.append((time.time(), times.user + times.system))

    def poll_scrapes(self) -> None:
        for target in self.prom.api("targets")["activeTargets"]:
            if not target["lastScrape"].startswith("0001"):
                key = (target["scrapeUrl"], target["lastScrape"])
                self.scrapes[key] = Span(target["scrapeUrl"], _epoch(target["lastScrape"]),
                                         target["lastScrapeDuration"])

    def cores_during(self, span: Span) -> float | None:
        """Cores Prometheus used over the span (from the CPU samples around it, which the
        sampler appends in time order)."""
        first = bisect.bisect_right(self.cpu, span.start, key=lambda s: s[0]) - 1
        last = bisect.bisect_left(self.cpu, span.end, key=lambda s: s[0])
        if first < 0 or last >= len(self.cpu) or first == last:
            return None
        (t0, c0), (t1, c1) = self.cpu[first], self.cpu[last]
        return (c1 - c0) / (t1 - t0)

    def beside(self, span: Span) -> tuple[float, float]:
        """Mean number of other group evaluations and of scrapes running during the span."""
        width = max(span.seconds, 1e-3)
        return (sum(span.overlap(e) for e in self.evaluations if e is not span) / width,
                sum(span.overlap(s) for s in self.scrapes.values()) / width)

    def report(self, alone: dict[str, float], interval: float) -> dict[str, Any]:
        """Each evaluation's slowdown over its group's cost alone, beside what ran with it:
        the evaluations over 1 s one by one, and the means for the slowed (over 2x) and the
        rest."""
        rows = []
        for span in self.evaluations:
            own = alone.get(span.name)
            groups, scrapes = self.beside(span)
            rows.append({"group": span.name, "seconds": round(span.seconds, 3),
                         "alone_s": own, "x_alone": round(span.seconds / own, 1) if own else None,
                         "groups_beside": round(groups, 2), "scrapes_beside": round(scrapes, 2),
                         "prometheus_cores": _round(self.cores_during(span))})
        slowed = [r for r in rows if r["x_alone"] and r["x_alone"] > 2]
        rest = [r for r in rows if r["x_alone"] and r["x_alone"] <= 2]
        offsets = self.offsets(interval)
        return {"evaluations": len(rows), "scrapes": len(self.scrapes),
                "slowed_over_2x": _means(slowed), "the_rest": _means(rest),
                "x_alone_by_groups_beside": _by_groups_beside(rows),
                "over_1s": sorted((r for r in rows if r["seconds"] > 1),
                                  key=lambda r: -r["seconds"]),
                "cores_by_second_of_round": self.round_profile(interval),
                "alone_s_by_second_of_round": demand_by_second(offsets, alone, interval),
                "group_offsets_s": offsets}

    def round_profile(self, interval: float) -> list[float]:
        """Cores Prometheus used in each second of the evaluation interval, over every round:
        flat when the work is spread, peaked where group offsets cluster."""
        busy, seen = [0.0] * math.ceil(interval), [0.0] * math.ceil(interval)
        for (t0, c0), (t1, c1) in itertools.pairwise(self.cpu):
            second = int(t0 % interval)
            busy[second] += c1 - c0
            seen[second] += t1 - t0
        return [round(b / s, 2) if s else 0.0 for b, s in zip(busy, seen, strict=True)]

    def offsets(self, interval: float) -> dict[str, float]:
        """Where in the interval each group starts (Prometheus hashes it from the group's name
        and file), in the order of the round."""
        first = {e.name: round(e.start % interval, 2) for e in self.evaluations}
        return dict(sorted(first.items(), key=lambda kv: kv[1]))


def demand_by_second(offsets: dict[str, float], alone: dict[str, float],
                     interval: float) -> list[float]:
    """Seconds of work alone that the groups starting in each second of the round bring: where
    their offsets bunch, a 2-core engine is saturated while it is idle in other seconds."""
    demand = [0.0] * math.ceil(interval)
    for name, offset in offsets.items():
        demand[int(offset)] += alone.get(name, 0.0)
    return [round(d, 2) for d in demand]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _by_groups_beside(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Evaluations by how many other groups ran beside them on average (0, under 1, 1-2, 2-3,
    3 or more): their count, median slowdown over their group's cost alone, and the cores
    Prometheus used meanwhile."""
    bins: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["x_alone"] is None:
            continue
        beside = row["groups_beside"]
        key = ("0" if beside == 0 else "<1" if beside < 1 else
               f"{int(beside)}-{int(beside) + 1}" if beside < 3 else ">=3")
        bins.setdefault(key, []).append(row)
    return {key: {"count": len(bins[key]),
                  "median_x_alone": _median([r["x_alone"] for r in bins[key]]),
                  "prometheus_cores": _median([r["prometheus_cores"] for r in bins[key]])}
            for key in ("0", "<1", "1-2", "2-3", ">=3") if key in bins}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def _means(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("groups_beside", "scrapes_beside", "prometheus_cores")
    return {"count": len(rows), **{
        k: _round(statistics.mean(v)) if (v := [r[k] for r in rows if r[k] is not None])
        else None for k in keys}}


def _stop_rule_groups(prom: Prometheus, rule_file: Path, timeout: float = 60.0) -> None:
    """Empty the rule file and make Prometheus reload it (SIGHUP): no group evaluates after."""
    rule_file.write_text("groups: []\n")
    if prom.proc is None:
        raise ServiceError("prometheus is not running")
    prom.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while prom.api("rules")["groups"]:
        if time.monotonic() > deadline:
            raise ServiceError(f"prometheus still evaluates rules {timeout:.0f} s after SIGHUP")
        time.sleep(0.5)


def _metrics(url: str) -> dict[str, float]:
    """One scrape of a component's own /metrics (Prometheus, VictoriaMetrics), as {sample line
    name: value}."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _busy_seconds(end: Any, start: Any) -> float:
    """CPU seconds the machine spent running anything, between two `psutil.cpu_times()`
    (guest time is in user time already; steal is the hypervisor's, reported apart)."""
    skip = ("idle", "iowait", "steal", "guest", "guest_nice")
    return sum(getattr(end, f) - getattr(start, f) for f in end._fields if f not in skip)


def _sum(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def _alert_counts(result: list[dict[str, Any]]) -> dict[str, int]:
    """{"<alertname> <state>": number of alerts} from ALERTS_BY_NAME."""
    return {f'{r["metric"]["alertname"]} {r["metric"]["alertstate"]}': int(float(r["value"][1]))
            for r in result}


def _query(engine: QueryAPI, expr: str) -> tuple[list[dict[str, Any]], str | None]:
    """The query's result, or no result and the engine's error: a query over every rank that
    hits the engine's limits at 65,536 ranks must not lose the run's other measurements."""
    try:
        return engine.query(expr), None
    except ServiceError as exc:
        return [], str(exc)


def measure_victoriametrics(args: argparse.Namespace, rule_file: Path,
                            scrape: list[dict[str, object]], tmp: Path) -> dict[str, object]:
    """Two vmagent shards -> VictoriaMetrics <- vmalert, as deployed (docs/victoriametrics.md).

    Group evaluation time is vmalert's own `vmalert_iteration_duration_seconds` (sum / count
    over the measured period): it includes the HTTP round trip and decoding of each rule's
    result, where Prometheus evaluates in-process."""
    vm = VictoriaMetrics(tmp / "vm")
    shards = [VMAgent(tmp / f"vmagent{i}", vm, [], scrape_interval=args.interval,
                      extra_scrape_configs=scrape, members=args.shards, member=i)
              for i in range(args.shards)]
    null_route = {"route": {"receiver": "null"}, "receivers": [{"name": "null"}]}
    with vm, alertmanager(tmp / "am", null_route) as am:
        for shard in shards:
            shard.start()
        vmalert = VMAlert(tmp / "vmalert", vm, rule_files=[rule_file], notifier_url=am.url,
                          evaluation_interval=args.interval, extra_args=[
                              "-remoteWrite.maxQueueSize=4000000",
                              "-remoteWrite.maxBatchSize=10000", "-remoteWrite.concurrency=4"])
        try:
            with vmalert:
                # first evaluations run on a partly filled window: measure after one interval
                time.sleep(2 * rules.parse_duration(args.interval) / 1000)
                before = {"vm": _metrics(vm.url), "vmalert": _metrics(vmalert.url)}
                t0 = time.monotonic()
                time.sleep(args.duration)
                after = {"vm": _metrics(vm.url), "vmalert": _metrics(vmalert.url)}
                elapsed = time.monotonic() - t0
                durations = {}
                for key, total in after["vmalert"].items():
                    if key.startswith("vmalert_iteration_duration_seconds_sum{"):
                        group = key.split('group="', 1)[1].split('"', 1)[0]
                        count_key = key.replace("_sum{", "_count{")
                        n = after["vmalert"][count_key] - before["vmalert"].get(count_key, 0)
                        spent = total - before["vmalert"].get(key, 0)
                        durations[group] = [spent / n] * int(n) if n else []
                rss = {name: psutil.Process(p.pid).memory_info().rss / 2**30
                       for name, p in [("victoria-metrics", vm), ("vmalert", vmalert),
                                       *((f"vmagent{i}", s) for i, s in enumerate(shards))]
                       if p.pid}
                errors = (_sum(after["vmalert"], "vmalert_recording_rules_errors_total")
                          + _sum(after["vmalert"], "vmalert_alerts_errors_total"))
                missed = _sum(after["vmalert"], "vmalert_iteration_missed_total")
            # What the rules found, read once vmalert stopped: at 65,536 ranks on 2 cores its
            # groups hold every search slot VictoriaMetrics has (2 per core).
            slow, slow_error = _query(vm, SLOW_RANKS)
            slowdown, slowdown_error = _query(vm, "run:robust_straggler_slowdown:ratio5m")
            alerts, alerts_error = _query(vm, ALERTS_BY_NAME)
        finally:
            for shard in shards:
                shard.stop()
    rows = (_sum(after["vm"], "vm_rows_inserted_total")
            - _sum(before["vm"], "vm_rows_inserted_total"))
    return {
        "shards": args.shards,
        "series_created_total": _sum(after["vm"], "vm_new_timeseries_created_total"),
        "samples_inserted_per_s": rows / elapsed,
        "rss_gib": {k: round(v, 3) for k, v in rss.items()},
        "rule_errors_total": errors,
        "iterations_missed_total": missed,
        "straggler_slowdown": slowdown[0]["value"][1] if slowdown else None,
        "slow_ranks_found": [s["metric"]["rank"] for s in slow],
        "alerts": _alert_counts(alerts),
        "query_errors": [e for e in (slow_error, slowdown_error, alerts_error) if e],
        "groups": {name: {"evaluations": len(v), "mean_s": round(v[0], 4) if v else None}
                   for name, v in sorted(durations.items())},
        "groups_x_baseline": {name: round(v[0] / durations["bench-baseline"][0], 1)
                              for name, v in sorted(durations.items())
                              if v and durations.get("bench-baseline")},
    }


# -- placement: where Prometheus 2.42 starts each group, and a model of the round ---------------
# Each group starts at xxhash64(label set {file=<path>, name=<group>}) mod interval into every
# interval (each label name and value followed by a 0xff byte). `--score-placements` scores
# candidate paths with each group's cost alone from an earlier run's quiet replay: groups running
# at once share the cores equally (processor sharing).

_MASK = (1 << 64) - 1
_P1, _P2, _P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P4, _P5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _xxh_lane(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * _P2) & _MASK, 31) * _P1) & _MASK


def xxh64(data: bytes) -> int:
    """XXH64 with seed 0 (the hash of Prometheus' label sets), in pure Python."""
    n, i = len(data), 0
    if n >= 32:
        v = [(_P1 + _P2) & _MASK, _P2, 0, (-_P1) & _MASK]
        while i + 32 <= n:
            v = [_xxh_lane(acc, lane)
                 for acc, lane in zip(v, struct.unpack_from("<4Q", data, i), strict=True)]
            i += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _MASK
        for acc in v:
            h = ((h ^ _xxh_lane(0, acc)) * _P1 + _P4) & _MASK
    else:
        h = _P5
    h = (h + n) & _MASK
    while i + 8 <= n:
        h = (_rotl(h ^ _xxh_lane(0, struct.unpack_from("<Q", data, i)[0]), 27) * _P1 + _P4) & _MASK
        i += 8
    if i + 4 <= n:
        lane = struct.unpack_from("<I", data, i)[0] * _P1 & _MASK
        h = (_rotl(h ^ lane, 23) * _P2 + _P3) & _MASK
        i += 4
    for byte in data[i:]:
        h = (_rotl(h ^ (byte * _P5 & _MASK), 11) * _P1) & _MASK
    h = ((h ^ (h >> 33)) * _P2) & _MASK
    h = ((h ^ (h >> 29)) * _P3) & _MASK
    return h ^ (h >> 32)


def start_offset(group: str, rule_file: str, interval: float) -> float:
    """Seconds into each interval at which Prometheus 2.42 evaluates `group` of `rule_file`."""
    key = b"file\xff" + rule_file.encode() + b"\xffname\xff" + group.encode() + b"\xff"
    return xxh64(key) % round(interval * 1e9) / 1e9


def predicted_durations(starts: Sequence[tuple[str, float, float, float]], cores: float,
                        horizon: float) -> dict[str, float]:
    """Median evaluation time per group of those starting in the first `horizon` seconds, for
    groups `(name, offset, interval, cost alone)` sharing `cores` equally while they run."""
    arrivals = sorted((offset + k * interval, name, cost)
                      for name, offset, interval, cost in starts if cost > 0
                      for k in range(int(horizon // interval) + 1)
                      if offset + k * interval < horizon)
    running: list[list[Any]] = []  # [work left, start, name]
    took: dict[str, list[float]] = {}
    now, i = 0.0, 0
    while i < len(arrivals) or running:
        if not running:
            now, name, cost = arrivals[i]
            running.append([cost, now, name])
            i += 1
            continue
        rate = min(1.0, cores / len(running))
        finish = now + min(job[0] for job in running) / rate
        arrive = arrivals[i][0] if i < len(arrivals) else float("inf")
        step = min(finish, arrive) - now
        for job in running:
            job[0] -= step * rate
        now += step
        for job in [job for job in running if job[0] <= 1e-12]:
            running.remove(job)
            took.setdefault(job[2], []).append(now - job[1])
        if arrive <= finish:
            _, name, cost = arrivals[i]
            running.append([cost, now, name])
            i += 1
    return {name: sorted(times)[len(times) // 2] for name, times in took.items()}


def score_placements(rule_groups: list[dict[str, Any]], result: Path, paths: int, pattern: str,
                     interval: float, cores: float = 1.0) -> dict[str, Any]:
    """The share of `paths` candidate rule-file paths whose every group of `rule_groups` the
    model puts under 1 s, and the best, median and worst of them, with costs from `result`'s
    quiet replay (its last JSON object: the whole result, after any line printed before it)."""
    text = result.read_text()
    groups = [(g["name"], rules.parse_duration(g["interval"]) / 1000 if "interval" in g
               else interval) for g in rule_groups]
    try:
        costs = json.loads(text[text.rindex("\n{\n") + 1:])["prometheus"]["quiet_replay_s"]
        if not any(costs.get(name) for name, _ in groups):
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{result} is no rules_scale.py result with a Prometheus quiet replay "
                         "of these rules (run it with --quiet-replays 1 or more)") from None
    scored = []
    for k in range(paths):
        path = pattern.format(k=k)
        took = predicted_durations([(name, start_offset(name, path, every), every,
                                     costs.get(name, 0.0)) for name, every in groups],
                                   cores, 4 * interval)
        scored.append((max(took.values()), sum(t > 1.0 for t in took.values()), path))
    scored.sort()
    report: dict[str, Any] = {
        "paths": len(scored),
        "share_with_every_group_under_1s": sum(s[0] <= 1.0 for s in scored) / len(scored)}
    for label, (slowest, over, path) in (("best", scored[0]), ("median", scored[len(scored) // 2]),
                                         ("worst", scored[-1])):
        report[label] = {"path": path, "slowest_group_s": round(slowest, 3),
                         "groups_over_1s": over}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--per-target", type=int, default=512)
    parser.add_argument("--duration", type=float, default=180, help="seconds of evaluation")
    parser.add_argument("--interval", default="15s", help="scrape and evaluation interval")
    parser.add_argument("--engine", choices=("prometheus", "victoriametrics", "both"),
                        default="prometheus",
                        help="both: VictoriaMetrics first, then Prometheus, same exporter")
    parser.add_argument("--shards", type=int, default=2, help="vmagent shards")
    parser.add_argument("--quiet-replays", type=int, default=3, metavar="N",
                        help="times every rule is replayed as an instant query after ingestion "
                             "and rule evaluation stopped (the minimum is reported per rule and "
                             "per group; 0: no replay)")
    parser.add_argument("--rank-shards", type=int, default=1, metavar="N",
                        help="evaluate the rules as `robust-metrics rules --rank-shards N` "
                             "renders them: per-rank rules split over N groups of ranks")
    parser.add_argument("--node-summaries", choices=rules.NODE_SUMMARY_SOURCES,
                        default="sidecar",
                        help="sidecar (default): the rules as rendered for a fleet with a sidecar "
                             "on every node, whose summaries of its ranks' windows the exporter "
                             "serves (one set per 8 ranks); rules: with the rule group that "
                             "records them from every rank's series as well (which skips the "
                             "run, since the summaries are served, but reads every rank)")
    parser.add_argument("--gpu-series", action="store_true",
                        help="every rank has its own GPU, and its sidecar serves the series NVML "
                             "gives for a healthy GPU (all but the NVLink counters): the GPU "
                             "rules read them")
    parser.add_argument("--flops", action="store_true",
                        help="ranks count model FLOPs (watch(flops_per_step=)) and GPUs have a "
                             "peak: the MFU rules get input and the per-rank cost of MFU shows")
    parser.add_argument("--cpu-profile", type=Path, metavar="FILE",
                        help="save a CPU profile of Prometheus over the first 60 s of the "
                             "measured window (pprof format); with Go on the PATH the result "
                             "gives the share of rule evaluation, series selection, garbage "
                             "collection and scrapes")
    parser.add_argument("--rule-file", type=Path, metavar="PATH",
                        help="write the rules to PATH (which must not exist; removed at the end) "
                             "instead of a new temporary path: Prometheus places each group in "
                             "the interval by a hash of its name and this path, so a fixed path "
                             "repeats a deployment's placement")
    parser.add_argument("--score-placements", type=Path, metavar="RESULT",
                        help="start nothing: score 2,000 rule-file paths (--placement-pattern) "
                             "by a model of four rounds with each group's cost alone from "
                             "RESULT, an earlier run's output, groups at once sharing one core; "
                             "print the best, median and worst paths for --rule-file")
    parser.add_argument("--placement-pattern", metavar="PATTERN",
                        default="/tmp/robust-metrics-placement/{k}/rules.yml",
                        help="candidate paths for --score-placements, {k} the candidate's number")
    args = parser.parse_args(argv)
    args.groups = rule_shards.shard_by_rank(
        rules.load_groups(node_summaries=args.node_summaries), args.rank_shards)
    if args.score_placements is not None:
        try:
            if args.placement_pattern.format(k=0) == args.placement_pattern.format(k=1):
                raise ValueError
        except (ValueError, KeyError, IndexError):
            parser.error(f"--placement-pattern {args.placement_pattern!r}: give a path with "
                         "{k}, the candidate's number, and no other {field}")
        try:
            report = score_placements([*args.groups, BASELINE], args.score_placements, 2000,
                                      args.placement_pattern,
                                      rules.parse_duration(args.interval) / 1000)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        print(json.dumps(report, indent=2))
        return 0
    if args.rule_file is not None:
        if args.rule_file.exists() or args.rule_file.is_symlink():
            parser.error(f"--rule-file {args.rule_file} exists; give a path the bench may create")
        try:
            args.rule_file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--rule-file {args.rule_file}: {exc}")

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        exporter = stack.enter_context(
            Exporter(args.ranks, args.per_target, args.flops, args.gpu_series))
        print(f"exporter: {args.ranks} ranks, {exporter.series} series "
              f"({exporter.series / args.ranks:.1f} per rank), {len(exporter.templates)} targets",
              flush=True)
        # resolved as Prometheus names it (processes.Prometheus): the path its placement hashes
        rule_file = (args.rule_file or Path(tmp) / "rules.yml").resolve()
        if args.rule_file is not None:
            stack.callback(rule_file.unlink, missing_ok=True)
        # baseline: the cheapest useful rules over every rank, to express group costs as ratios
        # in the same run (this 2-core VM is shared, so absolute times swing with its load)
        rule_file.write_text(rules.render([*args.groups, BASELINE]))
        scrape = [{"job_name": f"shard{i}", "metrics_path": f"/shard/{i}",
                   "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}
                  for i in range(len(exporter.templates))]
        result: dict[str, object] = {"ranks": args.ranks, "interval": args.interval,
                                     "rank_shards": args.rank_shards,
                                     "node_summaries": args.node_summaries,
                                     "rule_file": str(rule_file),
                                     "scraped_series_per_rank": exporter.series / args.ranks}
        if args.engine in ("victoriametrics", "both"):
            result["victoriametrics"] = measure_victoriametrics(args, rule_file, scrape, Path(tmp))
            print(json.dumps(result["victoriametrics"]), flush=True)
        if args.engine in ("prometheus", "both"):
            result["prometheus"] = measure_prometheus(args, exporter, rule_file, scrape, Path(tmp))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
