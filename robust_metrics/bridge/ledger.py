"""The incident ledger: what every incident cost, and which nodes keep being named.

For every finished incident the ledger keeps one row in the action log (table `ledger`): its run,
alert, the ranks and nodes it named (labels and the stack analysis' suspects), and five instants:

- **fault**: for a hang, the run's last step before the alert (Prometheus'
  `robust_last_step_timestamp_seconds` when the bridge received it); for a slow rank
  (`SLOW_RANK_ALERTS`), the scrape after which the named rank's compute per step rose to its
  level at the alert (`slowdown_start` over its raw `robust_step_compute_seconds` counters);
  otherwise, or when Prometheus does not show it, the alert's `startsAt` (Prometheus sends the
  instant the alert fired, after its `for` hold, so that detect time is only the delivery);
- **detected**: when the bridge received the alert;
- **acted**: when its remedial step (restart or drain_node) finished, or its last step for a
  chain without one;
- **recovered**: the run's first step after a restart, the smallest step timestamp newer than
  `acted` that Prometheus scraped (exact when a scrape falls between the first and the second
  step after the restart; otherwise late by less than one scrape interval); for a restarted
  run that failed again before any scrape saw it alive, its last step before that exit, which
  the sidecar read from the dead rank's files;
- **over-eviction**: the note says how many nodes a drain of every suspect's node took;
- **self-test**: each tested node's verdict (`pass`, `fail`, `skipped`, `error` for a sidecar
  that did not answer), its failed checks, why, and whether it was drained (`selftest`); a node
  that failed is named by the incident, so it counts in the suspect-node score, and a node that
  passed is not named by the test;
- **numerics**: for an incident of a non-finite value (`incidents.nan_alert_re`) that was
  restarted, the verdict of `bridge.numerics` once the run meets the bad step again:
  `persistent` (it came back at the same step: the data or the model; the bridge stops
  restarting the run and notifies), `transient` (the run passed the step cleanly: the machine;
  the node of the first reporting rank is named, a suspect mark, and gets a compute self-test),
  `recurred_elsewhere`, or `undecided` when the run did not get there in time; with the step,
  the first reporting rank and its node;
- **lost steps**: the highest step before the restart minus the step the run resumed from
  (`robust_start_step` of the ranks that stepped after the restart: the hook publishes the
  restored step at `watch()` or `set_step()`, so it does not matter which step a scrape catches;
  the sidecar keeps it for a rank that died before any scrape saw it).

The parts that compute (`named`, `acted_at`, `outcome_of`, `progress_after`) are pure functions
over the log and over query answers; `Ledger` reads Prometheus, writes the rows, updates the
metrics (time to detect, act and recover and lost steps by alert; incidents per node in the node
window) and answers the API. It runs on its own thread and never delays an action.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from robust_metrics import schema
from robust_metrics.bridge.config import BridgeConfig
from robust_metrics.bridge.metrics import BridgeMetrics
from robust_metrics.bridge.nan_verdict import NanEvidence, first_report, nan_verdict
from robust_metrics.bridge.payload import parse_time
from robust_metrics.bridge.policy import is_hang
from robust_metrics.bridge.store import ActionStore, Incident, Step
from robust_metrics.numbers import rank_order

__all__ = ["Entry", "Ledger", "LedgerMetrics", "Progress", "acted_at", "highest_step", "named",
           "outcome_of", "over_eviction_note", "persistent_finding", "progress_after",
           "selftest_verdicts"]

log = logging.getLogger(__name__)

Query = Callable[[str, float | None], list[dict[str, Any]]]
REMEDIAL = ("restart", "drain_node")
LAST_STEP = schema.LAST_STEP_TIMESTAMP.name
GLOBAL_STEP = schema.GLOBAL_STEP.name
EXIT_STEP = schema.RANK_EXIT_GLOBAL_STEP.name
START_STEP = schema.START_STEP.name
EXIT_START_STEP = schema.RANK_EXIT_START_STEP.name
EXIT_LAST_STEP = schema.RANK_EXIT_LAST_STEP_TIMESTAMP.name
NAN_STEP = schema.NONFINITE_FIRST_STEP.name
NAN_BATCH = schema.NONFINITE_FIRST_BATCH.name
NAN_COUNTERS = (schema.NONFINITE_LOSS.name, schema.NONFINITE_GRAD.name)
RANK_INFO = schema.RANK_INFO.name
COMPUTE = schema.STEP_COMPUTE.name
SLOW_RANK_ALERTS = frozenset({"SlowRank"})
"""Alerts that name a rank for computing slower than its peers; their fault is the rise of that
rank's compute per step."""
SLOW_SEARCH_S = 1800.0
"""How far before the alert a slow rank's rise is looked for (at most `incidents.lookback`)."""
SLOW_RISE = 1.03
"""The least rise (compute per step after / before) taken for the start of a slowdown."""

_TABLE = """
CREATE TABLE IF NOT EXISTS ledger (
    incident_id INTEGER PRIMARY KEY REFERENCES incidents(id),
    run TEXT NOT NULL,
    alertname TEXT NOT NULL,
    ranks TEXT NOT NULL,
    nodes TEXT NOT NULL,
    fault REAL,
    detected REAL NOT NULL,
    acted REAL,
    recovered REAL,
    highest_step REAL,
    resumed_step REAL,
    lost_steps INTEGER,
    outcome TEXT NOT NULL,
    note TEXT NOT NULL DEFAULT '',
    final INTEGER NOT NULL DEFAULT 0,
    selftest TEXT NOT NULL DEFAULT '{}',
    numerics TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS ledger_detected ON ledger(detected);
"""


@dataclass(frozen=True)
class Entry:
    """One incident in the ledger; durations are None where an instant is unknown."""

    incident_id: int
    run: str
    alertname: str
    ranks: list[str]
    nodes: list[str]
    fault: float | None
    detected: float
    acted: float | None
    recovered: float | None
    highest_step: float | None
    resumed_step: float | None
    lost_steps: int | None
    outcome: str
    note: str = ""
    final: bool = False
    selftest: dict[str, Any] = field(default_factory=dict)
    numerics: dict[str, Any] = field(default_factory=dict)

    @property
    def detect_s(self) -> float | None:
        return None if self.fault is None else max(0.0, self.detected - self.fault)

    @property
    def act_s(self) -> float | None:
        return None if self.acted is None else max(0.0, self.acted - self.detected)

    @property
    def recover_s(self) -> float | None:
        if self.acted is None or self.recovered is None:
            return None
        return max(0.0, self.recovered - self.acted)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(detect_s=self.detect_s, act_s=self.act_s, recover_s=self.recover_s)
        return out


@dataclass(frozen=True)
class Progress:
    """What Prometheus showed of a run after its restart."""

    recovered: float | None
    resumed_step: float | None


# ----------------------------------------------------------------------------- pure parts
def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def named(incident: Incident, steps: Sequence[Step]) -> tuple[list[str], list[str]]:
    """(ranks, nodes) an incident names: its labels (`rank`/`ranks`, `node`/`nodes`), the
    suspects of its stack analysis, and the nodes a drain step drained."""
    labels = incident.labels
    ranks = set(_split(labels.get("ranks", "")) + _split(labels.get("rank", "")))
    nodes = set(_split(labels.get("nodes", "")) + _split(labels.get("node", "")))
    for step in steps:
        analysis = step.data.get("analysis") if step.action == "dump_stacks" else None
        for suspect in (analysis or {}).get("suspects") or []:
            if isinstance(suspect, Mapping) and "rank" in suspect:
                ranks.add(str(suspect["rank"]))
                if suspect.get("node"):
                    nodes.add(str(suspect["node"]))
        if step.action == "drain_node" and step.status == "success":
            nodes.update(str(n) for n in step.data.get("nodes") or [])
    nodes.update(n for n, v in selftest_verdicts(steps).items() if v["verdict"] == "fail")
    return sorted(ranks, key=rank_order), sorted(nodes)


def selftest_verdicts(steps: Sequence[Step]) -> dict[str, dict[str, Any]]:
    """node -> {verdict, failed, detail, drained} from the incident's last self-test step."""
    tested = [s for s in steps if s.action == "selftest" and s.data.get("verdicts")]
    if not tested:
        return {}
    data = tested[-1].data
    drained = data.get("drained") or {}
    return {str(node): {"verdict": str(v.get("verdict")), "failed": list(v.get("failed") or []),
                        "detail": str(v.get("detail") or "")[:300],
                        "drained": bool((drained.get(node) or {}).get("ok"))}
            for node, v in data["verdicts"].items() if isinstance(v, Mapping)}


def acted_at(steps: Sequence[Step]) -> float | None:
    """When the remedial step finished (the last successful restart or drain_node), else when
    the chain's last step finished."""
    remedial = [s.finished for s in steps if s.action in REMEDIAL and s.status == "success"
                and s.finished is not None]
    if remedial:
        return max(remedial)
    finished = [s.finished for s in steps if s.finished is not None]
    return max(finished) if finished else None


def over_eviction_note(steps: Sequence[Step]) -> str:
    """How many nodes an over-eviction drained, for how many suspect ranks ('' if none)."""
    for step in steps:
        if step.action == "drain_node" and "evicted_nodes" in step.data:
            return (f"over-eviction: {step.data['evicted_nodes']} node(s) for "
                    f"{step.data.get('suspects')} suspect rank(s), {step.status}")
    return ""


def outcome_of(incident: Incident, steps: Sequence[Step]) -> str:
    """restart (waiting to recover), drained, crash_loop, failed, no_restart, or the incident's
    own closing status (skipped, ignored)."""
    if incident.status in ("skipped", "ignored"):
        return incident.status
    if any(step.guard == "crash_loop" for step in incident.plan):
        return "crash_loop"
    if any(s.action == "restart" and s.status == "success" for s in steps):
        return "restart"
    if any(s.action == "drain_node" and s.status == "success" for s in steps):
        return "drained"
    return "failed" if incident.status == "failed" else "no_restart"


def progress_after(acted: float, last_step: Iterable[tuple[float, float]],
                   min_step: Iterable[tuple[float, float]]) -> Progress:
    """The run's first step after `acted` and the step it resumed from.

    `last_step`: (time, newest step timestamp of any rank) points; `min_step`: (time, lowest
    start step of the ranks that stepped after the action) points, both as Prometheus evaluated
    them. The resumed step is the lowest seen after the action up to the first point that shows
    a new step.
    """
    first = next(((t, v) for t, v in sorted(last_step) if t > acted and v > acted), None)
    if first is None:
        return Progress(None, None)
    seen = [v for t, v in min_step if acted < t <= first[0]]
    return Progress(first[1], min(seen) if seen else None)


# ----------------------------------------------------------------------------- Prometheus
def _sel(run: str) -> str:
    return '{run="' + run.replace("\\", "\\\\").replace('"', '\\"') + '"}'


def _scalar(result: list[dict[str, Any]]) -> float | None:
    values = [float(r["value"][1]) for r in result if "value" in r]
    return max(values) if values else None


def _tagged(expr: str, source: str) -> str:
    """`expr` with a `from` label, so that `or` keeps a live and an exited series of one rank."""
    return f'label_replace({expr}, "from", "{source}", "", "")'


def highest_step(query: Query, run: str, lookback_s: float, at: float | None = None,
                 ) -> float | None:
    """The run's highest global step over the lookback (None: Prometheus has none): the ranks'
    live steps and the steps the sidecar read from the files of ranks that exited, so a crash
    right after a step counts that step however the scrapes fell."""
    window = f"{_sel(run)}[{lookback_s:.0f}s]"
    live = _tagged(f"max_over_time({GLOBAL_STEP}{window})", "live")
    exited = _tagged(f"max_over_time({EXIT_STEP}{window})", "exit")
    return _scalar(query(f"max({live} or {exited})", at))


def slowdown_start(sums: Sequence[tuple[float, float]], counts: Sequence[tuple[float, float]],
                   ) -> float | None:
    """When a rank's slowdown began, from its compute counters (`(timestamp, value)` scrapes of
    `robust_step_compute_seconds_sum` and `_count`): each pair of consecutive scrapes gives the
    mean compute per step between them; the split into a before and an after that fits two
    constant levels best (least squares) is the rise, taken when the after is at least
    `SLOW_RISE` times the before, with two intervals on each side. Returns the scrape that ends
    the last interval before the rise: the fault began after it, within one scrape interval.
    None when no rise shows (too few scrapes, a rank slow from its start). Intervals without a
    step, or across a counter reset, are left out."""
    by_time = dict(counts)
    intervals: list[tuple[float, float]] = []  # (scrape before, compute per step until the next)
    previous: tuple[float, float, float] | None = None
    for t, total in sorted(sums):
        if t not in by_time:
            continue
        if previous is not None:
            steps, spent = by_time[t] - previous[2], total - previous[1]
            if steps > 0 and spent >= 0:
                intervals.append((previous[0], spent / steps))
        previous = (t, total, by_time[t])
    n = len(intervals)
    if n < 4:
        return None
    values = [v for _, v in intervals]
    prefix, squares = [0.0], [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
        squares.append(squares[-1] + v * v)

    def cost(lo: int, hi: int) -> float:  # squared error of values[lo:hi] around their mean
        total = prefix[hi] - prefix[lo]
        return squares[hi] - squares[lo] - total * total / (hi - lo)

    split = min(range(2, n - 1), key=lambda k: cost(0, k) + cost(k, n))
    before, after = prefix[split] / split, (prefix[n] - prefix[split]) / (n - split)
    if before <= 0 or after < SLOW_RISE * before:
        return None
    return intervals[split][0]


def _points(result: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(float(t), float(v)) for r in result for t, v in r.get("values", [])]


class LedgerMetrics:
    """The ledger's series on the bridge's registry."""

    def __init__(self, metrics: BridgeMetrics) -> None:
        reg = metrics.registry

        def hist(spec: schema.MetricSpec) -> Histogram:
            return Histogram(spec.base_name, spec.help, spec.labels, buckets=spec.buckets,
                             registry=reg)

        self.detect = hist(schema.INCIDENT_DETECT)
        self.act = hist(schema.INCIDENT_ACT)
        self.recover = hist(schema.INCIDENT_RECOVER)
        lost, total, nodes = schema.INCIDENT_LOST_STEPS, schema.INCIDENTS, schema.NODE_INCIDENTS
        self.lost = Counter(lost.base_name, lost.help, lost.labels, registry=reg)
        self.incidents = Counter(total.base_name, total.help, total.labels, registry=reg)
        self.nodes = Gauge(nodes.base_name, nodes.help, nodes.labels, registry=reg)
        self._nodes: set[str] = set()

    def entered(self, entry: Entry) -> None:
        name = entry.alertname
        self.incidents.labels(alertname=name, outcome=entry.outcome).inc()
        for value, hist in ((entry.detect_s, self.detect), (entry.act_s, self.act),
                            (entry.recover_s, self.recover)):
            if value is not None:
                hist.labels(alertname=name).observe(value)
        if entry.lost_steps is not None:
            self.lost.labels(alertname=name).inc(entry.lost_steps)

    def node_counts(self, counts: Mapping[str, int]) -> None:
        for node in self._nodes - set(counts):
            with contextlib.suppress(KeyError):
                self.nodes.remove(node)
        for node, n in counts.items():
            self.nodes.labels(node=node).set(n)
        self._nodes = set(counts)


class Ledger:
    """Fills the ledger from the action log and Prometheus; `step()` does one pass."""

    def __init__(self, config: BridgeConfig, store: ActionStore, metrics: BridgeMetrics,
                 query: Query | None) -> None:
        self.config = config
        self.store = store
        self.query = query
        self.metrics = LedgerMetrics(metrics)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        with store.transaction() as db:
            for statement in _TABLE.split(";"):
                if statement.strip():
                    db.execute(statement)
            columns = {r[1] for r in db.execute("PRAGMA table_info(ledger)")}
            for column in ("selftest", "numerics"):  # a ledger written before they existed
                if column not in columns:
                    db.execute(f"ALTER TABLE ledger ADD COLUMN {column} TEXT NOT NULL "
                               "DEFAULT '{}'")
            rows = db.execute("SELECT run, numerics FROM ledger WHERE numerics LIKE "
                              "'%persistent%' ORDER BY incident_id").fetchall()
        self._persistent: dict[str, str] = {}  # run -> finding, read by the engine's decisions
        self._persistent_lock = threading.Lock()
        for run, numerics in rows:
            finding = json.loads(numerics)
            if finding.get("verdict") == "persistent":
                self._persistent[run] = persistent_finding(finding)
        # called once per verdict (the service notifies or runs a self-test); its answer is kept
        self.on_nan_verdict: Callable[[Entry], Mapping[str, Any]] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="bridge-ledger", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.config.incidents.poll_s):
            try:
                self.step()
            except Exception:
                log.exception("incident ledger pass failed")

    # ------------------------------------------------------------------ one pass
    def step(self, now: float | None = None) -> list[Entry]:
        """Enter finished incidents, complete the ones waiting to recover, refresh the node
        counts; returns the entries that became final in this pass."""
        now = time.time() if now is None else now
        final: list[Entry] = []
        for incident, steps in self._open_incidents():
            entry = self._entry(incident, steps, now)
            self._save(entry)
            if entry.final:
                self.metrics.entered(entry)
                final.append(entry)
        self.metrics.node_counts(self.node_counts(now))
        return final

    def _open_incidents(self) -> list[tuple[Incident, list[Step]]]:
        with self.store.transaction() as db:
            ids = [r[0] for r in db.execute(
                "SELECT i.id FROM incidents i LEFT JOIN ledger l ON l.incident_id = i.id "
                "WHERE i.status IN ('done', 'failed', 'skipped', 'ignored') "
                "AND i.alertname != '' AND (l.final IS NULL OR l.final = 0) ORDER BY i.id")]
        out = []
        for incident_id in ids:
            incident = self.store.get(incident_id)
            if incident is not None:
                out.append((incident, self.store.steps(incident_id)))
        return out

    def _entry(self, incident: Incident, steps: list[Step], now: float) -> Entry:
        ranks, nodes = named(incident, steps)
        outcome = outcome_of(incident, steps)
        acted = acted_at(steps)
        fault, note = self._fault(incident)
        note = "; ".join(n for n in (note, over_eviction_note(steps)) if n)
        base = Entry(incident.id, incident.run, incident.alertname, ranks, nodes, fault,
                     incident.received, acted, None, None, None, None, outcome, note,
                     selftest=selftest_verdicts(steps))
        if outcome != "restart" or acted is None:
            return _replace(base, final=True)
        if self.query is None:
            return _replace(base, outcome="not_recovered", final=True,
                            note="prometheus.url is not set: recovery not measured")
        highest = self._read(lambda: highest_step(self.query_at, incident.run,
                                                  self.config.incidents.lookback_s, acted))
        progress = self._read(lambda: self._progress(incident.run, acted, now))
        if progress is None or progress.recovered is None:
            if now - acted > self.config.incidents.recover_timeout_s:
                return _replace(base, outcome="not_recovered", highest_step=highest, final=True,
                                note="no step within incidents.recover_timeout after the action")
            return _replace(base, highest_step=highest)
        lost = None
        if highest is not None and progress.resumed_step is not None:
            lost = int(max(0.0, highest - progress.resumed_step))
        entry = _replace(base, outcome="recovered", recovered=progress.recovered,
                         highest_step=highest, resumed_step=progress.resumed_step,
                         lost_steps=lost, final=True)
        if self.config.incidents.nan_alert_re.fullmatch(incident.alertname):
            entry = self._numerics(entry, incident, acted, now)
        return entry

    # ------------------------------------------------------------------ non-finite values
    def persistent_nan(self, run: str) -> str | None:
        """The ledger's finding that the run's non-finite value persists, or None."""
        with self._persistent_lock:
            return self._persistent.get(run)

    def pending_nan(self, run: str, incident_id: int, now: float | None = None) -> str | None:
        """Why the verdict on an earlier non-finite value of `run` is still awaited, or None.

        Read from the action log itself, not from this ledger's entries: an alert that fires
        again as the restarted ranks come back arrives before the ledger's next pass has even
        entered the restart. An incident of `incidents.nan_alert_re` whose restart succeeded
        is awaited until its entry is final (a verdict, or no recovery within
        `incidents.recover_timeout`). Without Prometheus no verdict comes: nothing is awaited.
        Runs inside a decision's transaction, so it reads without opening one.
        """
        if self.query is None:
            return None
        now = time.time() if now is None else now
        with self.store.reading() as db:
            rows = db.execute(
                "SELECT i.id, i.alertname, MAX(s.finished) FROM incidents i "
                "JOIN steps s ON s.incident_id = i.id "
                "LEFT JOIN ledger l ON l.incident_id = i.id "
                "WHERE i.run = ? AND i.id != ? AND s.action = 'restart' "
                "AND s.status = 'success' AND (l.final IS NULL OR l.final = 0) "
                "GROUP BY i.id ORDER BY i.id DESC", (run, incident_id)).fetchall()
        for other, alertname, finished in rows:
            if (self.config.incidents.nan_alert_re.fullmatch(alertname) and finished is not None
                    and now - finished <= self.config.incidents.recover_timeout_s):
                return (f"the verdict on the non-finite value of incident {other} ({alertname}) "
                        "is awaited: the run has not met its step again since that restart; "
                        "another restart would only replay it")
        return None

    def _nan_evidence(self, incident: Incident, acted: float, now: float,
                      ) -> tuple[NanEvidence, dict[str, Any]]:
        """What Prometheus shows of the bad step before the restart and of the run after it,
        and the node of the first reporting rank and its batch position (when published)."""
        sel = _sel(incident.run)
        # After the all-reduce every rank has the non-finite gradients: a rank whose own loss
        # was non-finite is where it began, when there is one.
        first = None
        for only in (f" and on (run, rank) ({NAN_COUNTERS[0]}{sel} > 0)", ""):
            before = {r["metric"].get("rank", ""): float(r["value"][1]) for r in self.query_at(
                f"min by (rank) ({NAN_STEP}{sel}{only})", incident.received) if "value" in r}
            first = first_report(before)
            if first is not None:
                break
        if first is None:
            return NanEvidence(None, None, None, None), {}
        rank, step = first
        rank_sel = sel[:-1] + ', rank="' + rank.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        where = {"node": next((r["metric"].get("node") for r in self.query_at(
            f"max by (node) ({RANK_INFO}{rank_sel})", incident.received)), None),
            "batch": _scalar(self.query_at(f"max({NAN_BATCH}{rank_sel})", incident.received))}
        span = f"{max(1.0, now - acted):.0f}s"
        grew = " or ".join(f"(increase({c}{sel}[{span}]) > 0)" for c in NAN_COUNTERS)
        recurred = _min(self.query_at(f"min({NAN_STEP}{sel} and on (run, rank) ({grew}))",
                                      now))
        after = _scalar(self.query_at(
            f"max({GLOBAL_STEP}{sel} and on (run, rank) ({LAST_STEP}{sel} > {acted:.3f}))",
            now))
        return NanEvidence(step, rank, recurred, after), where

    def _numerics(self, entry: Entry, incident: Incident, acted: float, now: float) -> Entry:
        """Hold a recovered NaN incident open until the run meets the bad step again."""
        read = self._read(lambda: self._nan_evidence(incident, acted, now))
        if read is None:  # Prometheus away: try again at the next pass
            return _replace(entry, final=False)
        evidence, where = read
        node = where.get("node")
        verdict = nan_verdict(evidence)
        if verdict is None and evidence.step is not None and \
                now - acted <= self.config.incidents.recover_timeout_s:
            return _replace(entry, final=False)
        finding: dict[str, Any] = {
            "verdict": verdict or ("undecided" if evidence.step is not None else "unknown"),
            "step": evidence.step, "rank": evidence.rank, "node": node,
            "batch": where.get("batch"), "recurred_step": evidence.recurred_step}
        nodes = entry.nodes
        if verdict == "transient" and node:  # the suspect mark: the incident names the node
            nodes = sorted({*nodes, node})
        if verdict == "persistent":
            with self._persistent_lock:
                self._persistent[incident.run] = persistent_finding(finding)
        entry = _replace(entry, numerics=finding, nodes=nodes,
                         note="; ".join(n for n in (entry.note, _nan_note(finding)) if n))
        return self._after_verdict(entry) if verdict else entry

    def _after_verdict(self, entry: Entry) -> Entry:
        if self.on_nan_verdict is None:
            return entry
        try:
            extra = dict(self.on_nan_verdict(entry))
        except Exception as exc:  # a failed notification must not lose the verdict
            log.exception("acting on the NaN verdict of incident %d failed", entry.incident_id)
            extra = {"error": repr(exc)}
        selftest = {**entry.selftest, **dict(extra.pop("selftest", {}) or {})}
        return _replace(entry, selftest=selftest, numerics={**entry.numerics, **extra})

    def query_at(self, promql: str, at: float | None) -> list[dict[str, Any]]:
        assert self.query is not None
        return self.query(promql, at)

    @staticmethod
    def _read(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # Prometheus away: try again at the next pass
            log.warning("incident ledger: Prometheus read failed: %s", exc)
            return None

    def _fault(self, incident: Incident) -> tuple[float | None, str]:
        """A hang's fault is the run's last step before the bridge heard of it; a slow rank's,
        the rise of its compute; any other's, the alert's startsAt."""
        try:
            starts = parse_time(incident.starts_at).timestamp()
        except ValueError:
            starts = None
        rank = incident.labels.get("rank")
        if self.query is not None and incident.alertname in SLOW_RANK_ALERTS and rank:
            rose = self._read(lambda: self._slow_rank_start(incident.run, rank,
                                                            incident.received))
            if rose is None:
                return starts, (f"no rise of rank {rank}'s compute in Prometheus; fault time is "
                                "the alert's startsAt")
            return min(rose, incident.received), ""
        if not is_hang(self.config, incident.labels) or self.query is None:
            return starts, ""
        last = self._read(lambda: _scalar(self.query_at(
            f"max({LAST_STEP}{_sel(incident.run)})", incident.received)))
        if last is None:
            return starts, "no last step in Prometheus; fault time is the alert's startsAt"
        return min(last, incident.received), ""

    def _slow_rank_start(self, run: str, rank: str, at: float) -> float | None:
        """`slowdown_start` over the rank's compute counters before `at`; of several series of
        the rank (a restarted process), the one scraped last."""
        span = min(self.config.incidents.lookback_s, SLOW_SEARCH_S)
        quoted = {k: '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
                  for k, v in (("run", run), ("rank", rank))}
        result = self.query_at(f'{{__name__=~"{COMPUTE}_(sum|count)", run={quoted["run"]}, '
                               f'rank={quoted["rank"]}}}[{span:.0f}s]', at)
        series: dict[tuple[tuple[str, str], ...], dict[str, list[tuple[float, float]]]] = {}
        for r in result:
            labels = dict(r.get("metric", {}))
            name = labels.pop("__name__", "")
            points = [(float(t), float(v)) for t, v in r.get("values", [])]
            series.setdefault(tuple(sorted(labels.items())), {})[name] = points
        complete = [s for s in series.values()
                    if s.get(f"{COMPUTE}_sum") and s.get(f"{COMPUTE}_count")]
        if not complete:
            return None
        latest = max(complete, key=lambda s: s[f"{COMPUTE}_sum"][-1][0])
        return slowdown_start(latest[f"{COMPUTE}_sum"], latest[f"{COMPUTE}_count"])

    def _progress(self, run: str, acted: float, now: float) -> Progress:
        span = max(1.0, now - acted)
        sel = _sel(run)
        live_last, exit_last = f"{LAST_STEP}{sel}", f"{EXIT_LAST_STEP}{sel}"
        last = _points(self.query_at(
            f"max({_tagged(live_last, 'live')} or {_tagged(exit_last, 'exit')})"
            f"[{span:.0f}s:1s]", now))
        # The ranks that stepped since the action (not the hung processes being replaced) say
        # which step they resumed from, whichever of their steps a scrape caught first; a
        # process that died before any scrape saw it alive says so through the sidecar.
        live = f"{START_STEP}{sel} and on (run, rank) ({live_last} > {acted:.3f})"
        dead = f"{EXIT_START_STEP}{sel} and on (run, rank) ({exit_last} > {acted:.3f})"
        low = _points(self.query_at(
            f"min({_tagged(f'({live})', 'live')} or {_tagged(f'({dead})', 'exit')})"
            f"[{span:.0f}s:1s]", now))
        return progress_after(acted, last, low)

    # ------------------------------------------------------------------ storage
    def _save(self, entry: Entry) -> None:
        row = asdict(entry)
        row["ranks"] = json.dumps(entry.ranks)
        row["nodes"] = json.dumps(entry.nodes)
        row["selftest"] = json.dumps(entry.selftest)
        row["numerics"] = json.dumps(entry.numerics)
        row["final"] = int(entry.final)
        cols = ", ".join(row)
        marks = ", ".join("?" * len(row))
        with self.store.transaction() as db:
            db.execute(f"INSERT OR REPLACE INTO ledger ({cols}) VALUES ({marks})",
                       tuple(row.values()))

    def entries(self, run: str | None = None, alertname: str | None = None,
                limit: int = 100) -> list[Entry]:
        """The ledger, newest incident first."""
        where, args = [], []
        for column, value in (("run", run), ("alertname", alertname)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        sql = "SELECT * FROM ledger" + (" WHERE " + " AND ".join(where) if where else "")
        with self.store.transaction() as db:
            rows = db.execute(sql + " ORDER BY incident_id DESC LIMIT ?",
                              (*args, limit)).fetchall()
        return [_row_entry(r) for r in rows]

    def node_counts(self, now: float | None = None) -> dict[str, int]:
        """Incidents per node within the node window (the node alert's own not counted)."""
        now = time.time() if now is None else now
        since = now - self.config.incidents.node_window_s
        counts: dict[str, int] = {}
        with self.store.transaction() as db:
            rows = db.execute("SELECT nodes FROM ledger WHERE detected >= ? AND alertname != ?",
                              (since, self.config.incidents.node_alert)).fetchall()
        for (nodes,) in rows:
            for node in json.loads(nodes):
                counts[node] = counts.get(node, 0) + 1
        return counts


def _min(result: list[dict[str, Any]]) -> float | None:
    values = [float(r["value"][1]) for r in result if "value" in r]
    return min(values) if values else None


def persistent_finding(finding: Mapping[str, Any]) -> str:
    """The sentence a refused restart and its notification carry."""
    step, rank = finding.get("step"), finding.get("rank")
    return (f"the non-finite value came back at step {step:.0f} (first on rank {rank}) after "
            "a restart from a checkpoint" if step is not None else
            "the non-finite value came back at the same step after a restart")


def _nan_note(finding: Mapping[str, Any]) -> str:
    verdict, step, rank = finding["verdict"], finding.get("step"), finding.get("rank")
    where = f"step {step:.0f}, first on rank {rank}" if step is not None else "step unknown"
    where += f" (node {finding['node']})" if finding.get("node") else ""
    where += f", batch {finding['batch']:.0f}" if finding.get("batch") is not None else ""
    return {"persistent": f"non-finite value persistent at {where}: it follows the data or the "
                          "model; restarts stopped",
            "transient": f"non-finite value transient at {where}: the run passed the step "
                         "cleanly after the restart; the node is suspect",
            "recurred_elsewhere": f"non-finite value at {where} came back at an earlier step "
                                  f"({finding.get('recurred_step')})",
            "undecided": f"non-finite value at {where}: the run did not reach the step again "
                         "within incidents.recover_timeout",
            }.get(verdict, "non-finite value: no robust_nonfinite_first_step in Prometheus")


def _replace(entry: Entry, **changes: Any) -> Entry:
    return Entry(**{**asdict(entry), **changes})


def _row_entry(row: Any) -> Entry:
    data = dict(row)
    data["ranks"] = json.loads(data["ranks"])
    data["nodes"] = json.loads(data["nodes"])
    data["selftest"] = json.loads(data.get("selftest") or "{}")
    data["numerics"] = json.loads(data.get("numerics") or "{}")
    data["final"] = bool(data["final"])
    return Entry(**data)
