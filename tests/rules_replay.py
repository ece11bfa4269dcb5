"""One recorded data set, replayed into any engine that speaks the Prometheus APIs, and the shipped
rules evaluated over it the way a rule evaluator does: at each instant, group by group and rule by
rule, every expression is an instant query at that time; recorded series are written back at that
time (staleness markers where a series disappeared, as Prometheus and vmalert write them), so the
next rule and the next instant read them; alerts go pending and fire after their `for:`.

The engine is the only thing that differs, so what differs in the outputs is the query language.

The data set (`scenario`) is one 8-rank run (4 DP ranks x 2 pipeline stages, one node per
stage) scraped every 15 s for 45 minutes:

| minutes | what happens |
|---|---|
| 0-20 | healthy: 1 step per second, compute 0.6 s, blocked in collectives 0.4 s |
| 20- | rank 3 computes 0.9 s (a slow rank); the others wait for it, steps take 1.3 s |
| 23 | rank 1 reports a NaN loss (one non-finite loss step; every rank a non-finite gradient step) |
| 24 | rank 4's hook counts a loss spike; at 24.5 every rank counts a gradient-norm spike |
| 30-33 | every rank in the `checkpoint` phase: no steps, nothing may fire |
| 35 | GPU 2 of node 1 (rank 6) reports XID 79 |
| 36- | GPU 1 of node 1 (rank 5): an uncorrectable ECC error, a failed row remap, thermal |
|     | throttling, and lost to NVML |
| 40- | rank 2 hangs outside a collective: the others wait in the next one, nobody steps; its |
|     | process is stopped (state T) |
| 43- | rank 7's process exits without a normal end (its exit time is published) |
| 44 | the bridge restarts the run (`robust_bridge_actions_total{action="restart"}`) |

Beside it, run `short` (2 ranks on node 2) steps once a second for 10 minutes and ends normally:
its ranks close (the sidecar publishes `robust_rank_finished`) and exit a scrape later.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from robust_metrics import rules
from robust_metrics.hooks.windows import PUBLISHED, StepWindows, published_value
from tests.remote_write import STALE, Series, push

__all__ = ["RANKS", "RUN", "Replay", "Trace", "scenario"]

RUN = "replay"
RANKS = 8
SCRAPE_S = 15
MINUTES = 45
SLOW_RANK, NAN_RANK, HUNG_RANK, XID_RANK, EXIT_RANK = 3, 1, 2, 6, 7
SLOW_FROM, NAN_AT, CKPT, XID_AT, HANG_AT = 20 * 60, 23 * 60, (30 * 60, 33 * 60), 35 * 60, 40 * 60
EXIT_AT, RESTART_AT = 43 * 60, 44 * 60
SPIKE_RANK, LOSS_SPIKE_AT, NORM_SPIKE_AT = 4, 24 * 60, 24 * 60 + 30
GPU_FAULT_RANK, GPU_FAULT_AT = 5, 36 * 60
FLOPS_PER_STEP, PEAK_FLOPS = 4e14, 989e12  # every rank counts model FLOPs; H100 bf16 dense peak
SHORT_RUN, SHORT_RANKS, SHORT_END = "short", 2, 10 * 60


@dataclass
class _Rank:
    steps: float = 0.0
    last_step: float = 0.0
    compute: float = 0.0
    blocked: float = 0.0
    waiting: bool = False  # entered the next collective and waits in it
    windows: StepWindows = field(default_factory=StepWindows)  # what the hook keeps


def _node(rank: int) -> int:
    return rank // 4


def _advance(state: list[_Rank], t0: float, elapsed: float) -> None:
    """Move every rank from `elapsed - 15 s` to `elapsed` seconds after the start."""
    if elapsed > HANG_AT:  # the hung rank never enters the collective the others wait in
        for rank, s in enumerate(state):
            s.waiting = rank != HUNG_RANK
        return
    if CKPT[0] <= elapsed - SCRAPE_S < CKPT[1]:
        if elapsed >= CKPT[1]:  # leaving the checkpoint phase restarts the step clock
            for s in state:
                s.last_step = t0 + CKPT[1]
        return
    step_s = 1.3 if elapsed > SLOW_FROM else 1.0
    new_steps = SCRAPE_S / step_s
    for rank, s in enumerate(state):
        compute = 0.9 if (rank == SLOW_RANK and elapsed > SLOW_FROM) else 0.6
        ended = math.floor(s.steps + new_steps) - math.floor(s.steps)
        for i in range(ended):  # the whole steps of the interval, evenly spaced in it
            s.windows.add(t0 + elapsed - SCRAPE_S * (ended - 1 - i) / ended, step_s, compute)
        s.steps += new_steps
        s.compute += new_steps * compute
        s.blocked += new_steps * (step_s - compute)
        s.last_step = t0 + elapsed


def _rank_samples(rank: int, s: _Rank, t0: float, elapsed: float
                  ) -> Iterator[tuple[str, dict[str, str], float | object]]:
    base = {"run": RUN, "rank": str(rank)}
    steps = math.floor(s.steps)
    in_ckpt = CKPT[0] <= elapsed < CKPT[1]
    yield "robust_steps_total", base, steps
    yield "robust_global_step", base, steps
    yield "robust_last_step_timestamp_seconds", base, s.last_step
    yield "robust_rank_step_age_seconds", base, t0 + elapsed - s.last_step
    exited = rank == EXIT_RANK and elapsed >= EXIT_AT
    yield "robust_rank_process_alive", base, 0 if exited else 1
    if rank == HUNG_RANK and elapsed > HANG_AT:  # present only while stopped, as the sidecar does
        yield "robust_rank_process_stopped", base, 1
    if exited:
        yield "robust_rank_exit_timestamp_seconds", base, t0 + EXIT_AT
    for name, total in (("robust_step_duration_seconds", s.compute + s.blocked),
                        ("robust_step_compute_seconds", s.compute)):
        yield f"{name}_sum", base, total
        yield f"{name}_count", base, steps
    yield from _window_samples(base, s.windows, exited)
    coll = {**base, "op": "all_reduce", "group": "default_pg"}
    yield "robust_collective_duration_seconds_sum", coll, s.blocked
    yield "robust_collective_duration_seconds_count", coll, 2 * steps
    group = {**base, "group": "default_pg"}
    yield "robust_collectives_entered_total", group, 2 * steps + s.waiting
    yield "robust_collectives_completed_total", group, 2 * steps
    for phase in ("train", "eval", "checkpoint"):
        on = (phase == "checkpoint") if in_ckpt else (phase == "train")
        yield "robust_phase", {**base, "phase": phase}, float(on)
    nan = rank == NAN_RANK and NAN_AT <= elapsed < NAN_AT + SCRAPE_S
    yield "robust_loss", base, math.nan if nan else 2.0 - elapsed / 20000 + 0.01 * math.sin(
        elapsed / 60 + rank)
    yield "robust_grad_norm", base, 1.0 + 0.05 * math.cos(elapsed / 45 + rank)
    yield "robust_nonfinite_loss_steps_total", base, float(rank == NAN_RANK and elapsed >= NAN_AT)
    yield "robust_nonfinite_grad_steps_total", base, float(elapsed >= NAN_AT)
    # mixed precision: the GradScaler skips the NaN step on every rank, and one step in 500
    yield "robust_skipped_steps_total", base, float(elapsed >= NAN_AT) + elapsed // 500
    if rank == SPIKE_RANK and elapsed >= LOSS_SPIKE_AT:  # spike counters appear at the first
        yield "robust_loss_spikes_total", base, 1
    if elapsed >= NORM_SPIKE_AT:
        yield "robust_grad_norm_spikes_total", base, 1
    yield "robust_last_checkpoint_timestamp_seconds", base, t0 + (CKPT[1] if elapsed >= CKPT[1]
                                                                   else 0)
    info = {**base, "node": f"node{_node(rank)}", "local_rank": str(rank % 4),
            "world_size": str(RANKS), "pid": str(1000 + rank), "dp_rank": str(rank % 4),
            "pp_rank": str(rank // 4), "tp_rank": "0"}
    yield "robust_rank_info", info, 1
    gpu = {"node": f"node{_node(rank)}", "gpu": str(rank % 4), "uuid": f"GPU-{rank}"}
    yield "robust_rank_gpu_info", {**base, **gpu}, 1
    yield "robust_model_flops_total", base, steps * FLOPS_PER_STEP
    yield "robust_gpu_peak_flops", {"node": gpu["node"], "gpu": gpu["gpu"]}, PEAK_FLOPS
    yield "robust_rank_gpu_peak_flops", base, PEAK_FLOPS
    yield "robust_gpu_info", {**gpu, "name": "H100"}, 1
    faulty = float(rank == GPU_FAULT_RANK and elapsed >= GPU_FAULT_AT)
    device = {"node": gpu["node"], "gpu": gpu["gpu"]}
    yield "robust_gpu_lost", device, faulty
    yield "robust_gpu_ecc_errors_total", {**device, "type": "uncorrected"}, faulty
    yield "robust_gpu_row_remap_failure", device, faulty
    yield "robust_gpu_clock_throttle", {**device, "reason": "hw_thermal_slowdown"}, faulty
    xid = {"node": gpu["node"], "gpu": gpu["gpu"], "xid": "79"}
    yield "robust_gpu_xid_errors_total", xid, float(rank == XID_RANK and elapsed >= XID_AT)


def _window_samples(base: dict[str, str], windows: StepWindows, exited: bool
                    ) -> Iterator[tuple[str, dict[str, str], float | object]]:
    """The step windows the hook publishes; a dead process's gauges vanish (stale)."""
    for spec, names in PUBLISHED:
        for window in names:
            stats = windows.stats(window)
            if stats is None:
                continue
            value = STALE if exited else published_value(stats, spec.name)
            yield spec.name, {**base, "window": window}, value


def _short_run_samples(rank: int, t0: float, elapsed: float
                       ) -> Iterator[tuple[str, dict[str, str], float | object]]:
    """Run `short`: a step a second until it ends normally at SHORT_END; its rank's gauges go
    stale when its process exits a scrape later; its counters stay, as the sidecar keeps a dead
    process's counters."""
    base = {"run": SHORT_RUN, "rank": str(rank)}
    closed, exited = elapsed >= SHORT_END, elapsed >= SHORT_END + SCRAPE_S
    yield "robust_rank_process_alive", base, 0.0 if exited else 1.0
    if closed:
        yield "robust_rank_finished", base, 1.0
    ran = min(elapsed, SHORT_END)
    for counter in ("robust_steps_total", "robust_step_duration_seconds_sum",
                    "robust_step_duration_seconds_count"):
        yield counter, base, ran
    if exited and elapsed > SHORT_END + SCRAPE_S:
        return
    live: list[tuple[str, dict[str, str], float]] = [
        ("robust_global_step", base, ran),
        ("robust_last_step_timestamp_seconds", base, t0 + ran),
        ("robust_phase", {**base, "phase": "train"}, 1.0),
        ("robust_rank_info", {**base, "node": "node2", "local_rank": str(rank),
                              "world_size": str(SHORT_RANKS), "pid": str(2000 + rank),
                              "dp_rank": str(rank), "pp_rank": "0", "tp_rank": "0"}, 1.0)]
    if not closed:  # no step age for a rank that closed, as the sidecar does
        live.append(("robust_rank_step_age_seconds", base, 0.0))
    for name, labels, value in live:
        yield name, labels, STALE if exited else value


def scenario(t0: float) -> list[Series]:
    """Every input series of the data set, starting at `t0` (seconds), as remote-write series."""
    state = [_Rank(last_step=t0) for _ in range(RANKS)]
    series: dict[tuple[tuple[str, str], ...], list[tuple[int, float | object]]] = {}
    for tick in range(MINUTES * 60 // SCRAPE_S + 1):
        elapsed = tick * SCRAPE_S
        if tick:
            _advance(state, t0, elapsed)
        ms = int((t0 + elapsed) * 1000)
        for rank, s in enumerate(state):
            node = f"node{_node(rank)}"
            target = {"job": "robust-metrics-sidecar", "instance": node}
            for name, labels, value in _rank_samples(rank, s, t0, elapsed):
                key = tuple(sorted({"__name__": name, **target, **labels}.items()))
                series.setdefault(key, []).append((ms, value))
        for rank in range(SHORT_RANKS):
            target = {"job": "robust-metrics-sidecar", "instance": "node2"}
            for name, labels, value in _short_run_samples(rank, t0, elapsed):
                key = tuple(sorted({"__name__": name, **target, **labels}.items()))
                series.setdefault(key, []).append((ms, value))
        # the bridge restarts the run once its rank 7 has exited
        bridge = {"job": "robust-bridge", "instance": "bridge", "run": RUN, "action": "restart",
                  "result": "success", "__name__": "robust_bridge_actions_total"}
        key = tuple(sorted(bridge.items()))
        series.setdefault(key, []).append((ms, float(elapsed >= RESTART_AT)))
        for n in range(RANKS // 4 + 1):
            target = {"job": "robust-metrics-sidecar", "instance": f"node{n}"}
            for name, extra in (("up", {}), ("robust_sidecar_collector_success",
                                             {"node": f"node{n}", "collector": "ranks"})):
                key = tuple(sorted({"__name__": name, **target, **extra}.items()))
                series.setdefault(key, []).append((ms, 1.0))
    return [(dict(k), v) for k, v in series.items()]


def _key(metric: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(metric.items()))


@dataclass
class Trace:
    """What one engine produced: per instant, every rule's output series with their values, and
    the firing alerts' label sets."""

    records: dict[tuple[float, str], dict[tuple[tuple[str, str], ...], float]] = field(
        default_factory=dict)
    alerts: dict[tuple[float, str], set[tuple[tuple[str, str], ...]]] = field(
        default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class Replay:
    """Evaluates `groups` on one engine (its base URL) at `times`, writing records back."""

    def __init__(self, url: str, groups: list[dict[str, Any]], *, flush_url: str | None = None
                 ) -> None:
        self.url = url
        self.groups = groups
        self.flush_url = flush_url  # VictoriaMetrics: make written samples searchable now
        self.client = httpx.Client(timeout=60)
        self.previous: dict[str, set[tuple[tuple[str, str], ...]]] = {}
        self.active_since: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.dirty: set[str] = set()

    def write(self, series: list[Series]) -> None:
        push(self.client, f"{self.url}/api/v1/write", series)
        if self.flush_url:
            self.client.get(self.flush_url).raise_for_status()

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        if self.flush_url and self.dirty and any(re.search(rf"\b{re.escape(n)}\b", expr)
                                                 for n in self.dirty):
            self.client.get(self.flush_url).raise_for_status()
            self.dirty.clear()
        body = self.client.get(f"{self.url}/api/v1/query",
                               params={"query": expr, "time": f"{at:.3f}"}).json()
        if body.get("status") != "success":
            raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def run(self, times: list[float]) -> Trace:
        trace = Trace()
        for at in times:
            for group in self.groups:
                for rule in group["rules"]:
                    self._evaluate(rule, at, trace)
        self.client.close()
        return trace

    def _evaluate(self, rule: dict[str, Any], at: float, trace: Trace) -> None:
        name = rule.get("record") or rule["alert"]
        try:
            result = self.query(rule["expr"], at)
        except RuntimeError as exc:
            trace.errors.setdefault(name, str(exc))
            result = []
        extra = dict(rule.get("labels") or {})
        outputs: dict[tuple[tuple[str, str], ...], float] = {}
        for sample in result:
            metric = {k: v for k, v in sample["metric"].items() if k != "__name__"}
            outputs[_key({**metric, **extra})] = float(sample["value"][1])
        if "record" in rule:
            # One name may be recorded by several rules with different static labels (the
            # straggler verdict); each rule's own series go stale, not its siblings'.
            self._record((name, _key(extra)), outputs, at)
            trace.records.setdefault((at, name), {}).update(outputs)
            return
        firing = set()
        for key in outputs:
            since = self.active_since.setdefault((name, key), at)
            if at - since >= rules.parse_duration(rule.get("for", "0s")) / 1000:
                firing.add(key)
        for stale in [k for k in self.active_since if k[0] == name and k[1] not in outputs]:
            del self.active_since[stale]
        trace.alerts[(at, name)] = firing

    def _record(self, rule: tuple[str, tuple[tuple[str, str], ...]],
                outputs: dict[tuple[tuple[str, str], ...], float], at: float) -> None:
        name, ms = rule[0], int(at * 1000)
        series: list[Series] = [({**dict(k), "__name__": name}, [(ms, v)])
                                for k, v in outputs.items()]
        series += [({**dict(k), "__name__": name}, [(ms, STALE)])
                   for k in self.previous.get(rule, set()) - outputs.keys()]
        self.previous[rule] = set(outputs)
        if series:
            push(self.client, f"{self.url}/api/v1/write", series)
            self.dirty.add(name)
