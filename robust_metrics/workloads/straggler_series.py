"""Synthetic per-rank step timing of a synchronous job, scraped every 15 s, as the hook publishes it.

The statistical straggler rules (alert_rules/stragglers.yml, SlowRank's second branch) judge a
rank by its mean compute per step against the run's step-to-step spread. Whether they stay silent
on noise and name a rank 1.1x slower is a question about random series, which constant counters
(`0+9x40` in a promtool file) cannot ask. This module draws them: every step, each rank computes
`base x its slowdown x (1 + jitter x U(-1, 1))` seconds, the step ends when the slowest rank has
computed plus a transfer time (a bulk-synchronous step: every other rank waits in the collective),
and a scrape every 15 s sees what the hook publishes of the steps completed by then: the step
counter, the last step's time and age, the phase, and the step windows the rules compare
(robust_step_compute_mean_seconds and the other gauges of hooks/windows.py `PUBLISHED`), computed
by the hook's own code (`StepWindows` fed every step's end, duration and compute, read through
its `WindowPublisher` at the scrape).

It feeds the promtool cases in alert_rules/tests/stragglers_stat_test.yml (written by
`python -m tests.straggler_stat_cases`) and bench/straggler_curve.py. A scenario is seeded: the
same scenario gives the same series on every machine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from robust_metrics import rules, schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.windows import PUBLISHED, StepWindows, WindowPublisher

__all__ = ["SCRAPE_S", "RankWindows", "Scenario", "Scrape", "promtool_file", "promtool_series",
           "run_steps", "scrape_series", "scrapes"]

SCRAPE_S = 15.0
"""Seconds between scrapes, Prometheus' default interval and the rules' design point."""

WINDOW_DIGITS = 5
"""Decimals of the window gauges in promtool files: 10 us of a mean, a fraction of the standard
error the rules test against (about 4 ms for 60 steps of +-10% jitter on 0.6 s)."""


@dataclass(frozen=True)
class Scenario:
    """One run: its ranks, how their compute varies, and for how long it is scraped.

    `slow` maps a rank to (factor, from_s): from `from_s` seconds on (until `slow_until`), it
    computes `factor` times longer. `contention` = (factor, period_s, from_s): from `from_s` on,
    one rank at a time computes `factor` times longer, a different one each `period_s` (rank k
    in period k, cycling), as CPU contention that moves between ranks does. `stall` =
    (rank, at_s, seconds): the first step from `at_s` on takes `seconds` longer on that rank
    (a rank stopped and resumed, a long host-side pause), every other rank waiting for it in
    the step's collective. `pause` =
    (from_s, to_s): no steps, every rank in the `pause_phase` phase (a checkpoint or an
    evaluation that every rank takes part in).
    """

    ranks: int
    minutes: float
    base: float = 0.6
    transfer: float = 0.4
    jitter: float = 0.1
    slow: dict[int, tuple[float, float]] = field(default_factory=dict)
    slow_until: float = math.inf
    contention: tuple[float, float, float] | None = None
    stall: tuple[int, float, float] | None = None
    pause: tuple[float, float] | None = None
    pause_phase: str = "checkpoint"
    seed: int = 0

    def slowdown(self, rank: int, t: float) -> float:
        """The factor by which `rank` computes slower in a step that starts at `t` seconds."""
        factor = 1.0
        if rank in self.slow and self.slow[rank][1] <= t < self.slow_until:
            factor *= self.slow[rank][0]
        if self.contention is not None:
            extra, period, start = self.contention
            if t >= start and int((t - start) // period) % self.ranks == rank:
                factor *= extra
        return factor

    def paused(self, t: float) -> bool:
        return self.pause is not None and self.pause[0] <= t < self.pause[1]


class RankWindows:
    """One rank's step windows as its hook keeps and publishes them: the hook's `StepWindows`,
    read through its `WindowPublisher` into a `MetricStore` of the rank's own, so that a scrape
    sees the values a live rank would serve (the same windows, the same arithmetic)."""

    def __init__(self) -> None:
        self.windows = StepWindows()
        self._store = MetricStore({})
        self._store.on_read(WindowPublisher(self._store, self.windows).refresh)

    def add(self, at: float, duration: float, compute: float) -> None:
        """One step of the rank that ended at `at` seconds."""
        self.windows.add(at, duration, compute)

    def read(self) -> dict[tuple[str, str], float]:
        """(metric, window) -> value of every window gauge, as a scrape now reads them; empty
        before the rank's first step (the hook creates them at its first step)."""
        return {(sample.name, sample.series.label_map()["window"]): sample.value
                for sample in self._store.samples()}


@dataclass
class _Counters:
    steps: int = 0
    compute: float = 0.0
    duration: float = 0.0
    last_step: float = 0.0
    windows: RankWindows = field(default_factory=RankWindows)


@dataclass(frozen=True)
class Scrape:
    """What one scrape at `t` seconds sees of one rank. `steps`, `compute`, `duration`: the
    rank's totals (steps, seconds of compute, seconds of steps) since the start; `windows`: the
    hook's window gauges, (metric, window) -> value (`RankWindows.read`)."""

    t: float
    rank: int
    steps: int
    compute: float
    duration: float
    last_step: float
    paused: bool
    windows: Mapping[tuple[str, str], float] = field(default_factory=dict)


def run_steps(scenario: Scenario) -> Iterator[tuple[float, float, list[float]]]:
    """(end time, duration, each rank's compute) of every step, in order, until the end. A
    pause is not part of the step after it (the hook restarts the step clock on leaving a
    phase)."""
    rng = random.Random(scenario.seed)
    t, end = 0.0, scenario.minutes * 60
    stall = scenario.stall
    while t < end:
        if scenario.paused(t):
            t = scenario.pause[1]  # type: ignore[index]
            continue
        computes = [scenario.base * scenario.slowdown(r, t)
                    * (1 + scenario.jitter * rng.uniform(-1, 1)) for r in range(scenario.ranks)]
        if stall is not None and t >= stall[1]:
            computes[stall[0]] += stall[2]
            stall = None
        duration = max(computes) + scenario.transfer
        t += duration
        yield t, duration, computes


def scrapes(scenario: Scenario) -> list[list[Scrape]]:
    """Per scrape (at 0, 15, 30 s, ... up to the end), one `Scrape` per rank."""
    counters = [_Counters() for _ in range(scenario.ranks)]
    out: list[list[Scrape]] = []
    count = int(scenario.minutes * 60 // SCRAPE_S) + 1
    steps = run_steps(scenario)
    pending = next(steps, None)
    for k in range(count):
        now = k * SCRAPE_S
        while pending is not None and pending[0] <= now:
            end, duration, computes = pending
            for c, compute in zip(counters, computes, strict=True):
                c.steps += 1
                c.compute += compute
                c.duration += duration
                c.last_step = end
                c.windows.add(end, duration, compute)
            pending = next(steps, None)
        out.append([Scrape(now, r, c.steps, c.compute, c.duration, c.last_step,
                           scenario.paused(now), c.windows.read())
                    for r, c in enumerate(counters)])
    return out


def _number(value: float, digits: int) -> str:
    text = f"{value:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _values(numbers: list[float], digits: int) -> str:
    return " ".join(_number(v, digits) for v in numbers)


def promtool_series(scenario: Scenario, run: str) -> list[dict[str, str]]:
    """promtool `input_series` of the run: the step counter, the window gauges (hooks/windows.py
    `PUBLISHED`), the last step's timestamp, the step age, the phase of every rank, and its node
    (`n<rank>` on `robust_rank_info`)."""
    return scrape_series(scrapes(scenario), run, pause_phase=scenario.pause_phase)


def scrape_series(table: list[list[Scrape]], run: str, *, pause_phase: str = "checkpoint",
                  topology: Mapping[int, Mapping[str, str]] | None = None
                  ) -> list[dict[str, str]]:
    """promtool `input_series` of scrapes (one row per scrape, one `Scrape` per rank, in the
    same order in every row), as `promtool_series` describes. `topology` maps a rank to more
    labels of its `robust_rank_info` (dp_rank, pp_rank, tp_rank) besides its node `n<rank>`."""
    out = []
    for column in range(len(table[0])):
        rows = [scrape[column] for scrape in table]
        rank = rows[0].rank
        labels = f'run="{run}",rank="{rank}"'
        for name, numbers, digits in (
            (schema.STEPS_TOTAL.name, [s.steps for s in rows], 0),
            (schema.LAST_STEP_TIMESTAMP.name, [s.last_step for s in rows], 3),
        ):
            out.append({"series": f"{name}{{{labels}}}", "values": _values(numbers, digits)})
        # the window gauges, from the rank's first step on (absent before, as the hook has none)
        for spec, windows in PUBLISHED:
            for window in windows:
                key = (spec.name, window)
                values = [_number(s.windows[key], WINDOW_DIGITS) if key in s.windows else "_"
                          for s in rows]
                out.append({"series": f'{spec.name}{{{labels},window="{window}"}}',
                            "values": " ".join(values)})
        # the step age as the rank's in-process exporter serves it: at the scrape, once stepped
        ages = [_number(s.t - s.last_step, 3) if s.last_step > 0 else "_" for s in rows]
        out.append({"series": f"robust_rank_step_age_seconds{{{labels}}}",
                    "values": " ".join(ages)})
        for phase, on in (("train", False), (pause_phase, True)):
            flags = [float(s.paused == on) for s in rows]
            out.append({"series": f'robust_phase{{{labels},phase="{phase}"}}',
                        "values": _values(flags, 0)})
        info = "".join(f',{k}="{v}"' for k, v in (topology or {}).get(rank, {}).items())
        out.append({"series": f'robust_rank_info{{{labels},node="n{rank}"{info}}}',
                    "values": f"1x{len(rows) - 1}"})
    return out


def promtool_file(header: str, rule_files: Sequence[str], tests: list[dict[str, Any]], *,
                  directory: Path = rules.RULES_DIR / "tests") -> str:
    """A promtool test file: `tests` over `rule_files` (paths relative to `directory`, where the
    file will be; alert_rules/tests by default), the groups evaluated in their files' order,
    every 15 s."""
    order = [g["name"] for f in rule_files
             for g in yaml.safe_load((directory / f).read_text())["groups"]]
    spec = {"rule_files": list(rule_files), "evaluation_interval": "15s",
            "group_eval_order": order, "tests": tests}
    return header + yaml.safe_dump(spec, sort_keys=False, width=100)
