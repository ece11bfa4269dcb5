"""The demo's fault script: healthy warm-up, one slow rank, a NaN loss, one hung rank.

Each fault is written into the job's `faults.json` (read by the ranks at step boundaries), then the
script waits for the shipped rules to fire the expected alert for the expected rank and for the
bridge to finish its actions. Every step is recorded as a `FaultRecord` for the summary table.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from robust_metrics.demo.stack import QUERY_ERRORS, RUN, DemoStack

__all__ = ["FAULTS", "Fault", "FaultRecord", "Scenario", "problems"]


@dataclass(frozen=True)
class Fault:
    name: str
    alert: str
    rank: int
    spec: dict[str, Any]
    action: str  # the bridge action expected to follow, or "" for none
    stops_training: bool = False


FAULTS: tuple[Fault, ...] = (
    Fault("slow rank", "SlowRank", 2, {"slow_rank": 2, "slow_seconds": 0.25}, "checkpoint"),
    Fault("NaN loss", "NonFiniteLoss", 1, {"nan_rank": 1, "nan_in_steps": 3}, ""),
    Fault("hung rank", "RankHang", 3, {"hang_rank": 3, "hang_in_steps": 3}, "restart",
          stops_training=True),
)


@dataclass
class FaultRecord:
    fault: Fault
    injected_at: float
    detected_at: float | None = None
    alert_rank: str = ""
    actions: list[str] = field(default_factory=list)
    result: str = "not detected"

    @property
    def latency(self) -> float | None:
        return None if self.detected_at is None else self.detected_at - self.injected_at


def problems(records: list[FaultRecord], *, resumed_from: int | None,
             healthy_alerts: list[str] | None = None) -> list[str]:
    """What the demo promised and did not do: every fault caught by its alert naming the right
    rank, the bridge's action done, after a restart the job training again from its checkpoint,
    and on a run without faults no alert (`healthy_alerts`: those that fired on such a run).
    Empty when the run kept every promise (exit status 0)."""
    out = [f"{name} fired on a run without faults" for name in healthy_alerts or []]
    for r in records:
        f = r.fault
        if r.detected_at is None:
            out.append(f"{f.name}: {f.alert} did not fire")
        elif r.alert_rank != str(f.rank):
            out.append(f"{f.name}: {f.alert} named rank {r.alert_rank or '-'}, not rank {f.rank}")
        elif f.action and r.result != "acted":
            out.append(f"{f.name}: the bridge's {f.action} ended as '{r.result}' "
                       f"({', '.join(r.actions) or 'no steps'})")
    restarted = any(r.fault.action == "restart" and r.fault.stops_training for r in records)
    if restarted and resumed_from is None:
        out.append("the job did not resume from its checkpoint after the restart")
    return out


class Scenario:
    """Plays `FAULTS` against a running `DemoStack`."""

    def __init__(self, stack: DemoStack, *, detect_timeout: float = 120.0,
                 on_event: Callable[[str], None] = print) -> None:
        self.stack = stack
        self.detect_timeout = detect_timeout
        self.say = on_event
        self.records: list[FaultRecord] = []

    # -- observations ----------------------------------------------------------------------
    def global_step(self) -> int:
        result = self.stack.query(f'max(robust_global_step{{run="{RUN}"}})')
        return int(float(result[0]["value"][1])) if result else 0

    def wait_for_steps(self, steps: int, timeout: float) -> int:
        """Wait until the job has completed `steps` more steps; returns the step reached."""
        deadline = time.monotonic() + timeout
        start = self.global_step()
        while time.monotonic() < deadline:
            now = self.global_step()
            if now >= start + steps:
                return now
            time.sleep(1)
        raise TimeoutError(f"the job made no progress for {timeout:.0f}s (step {start})")

    def _alert_for(self, name: str) -> dict[str, Any] | None:
        for alert in self.stack.firing_alerts():
            if alert["labels"].get("alertname") == name and alert["labels"].get("run") == RUN:
                return alert
        return None

    def _finished_incidents(self, alert: str) -> list[dict[str, Any]]:
        """The bridge's incidents for `alert` that reached a final status."""
        return [i for i in self.stack.actions()
                if i.get("alertname") == alert and i.get("status") in ("done", "failed")]

    # -- the script ------------------------------------------------------------------------
    def _write_faults(self, spec: dict[str, Any]) -> None:
        """Replace `faults.json` at once: a rank never reads it half-written."""
        path = self.stack.job_dir / "faults.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(path)

    def inject(self, fault: Fault) -> FaultRecord:
        step = self.global_step()
        self._write_faults(dict(fault.spec))
        record = FaultRecord(fault, time.time())
        self.records.append(record)
        self.say(f"injected: {fault.name} on rank {fault.rank} at step {step}")
        return record

    def clear(self) -> None:
        self._write_faults({})

    def detect(self, record: FaultRecord) -> None:
        fault = record.fault
        deadline = time.monotonic() + self.detect_timeout
        while time.monotonic() < deadline:
            alert = self._alert_for(fault.alert)
            if alert is not None:
                record.detected_at = time.time()
                record.alert_rank = alert["labels"].get("rank", "")
                record.result = "detected"
                self.say(f"detected: {fault.alert} rank={record.alert_rank} after "
                         f"{record.latency:.1f}s")
                return
            time.sleep(0.5)
        self.say(f"NOT detected: {fault.alert} within {self.detect_timeout:.0f}s")

    def await_actions(self, record: FaultRecord, timeout: float = 120.0) -> None:
        if not record.fault.action or record.detected_at is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            incidents = self._finished_incidents(record.fault.alert)
            steps = [s for i in incidents for s in i.get("steps", [])]
            if any(s.get("action") == record.fault.action for s in steps):
                record.actions = [f"{s['action']}:{s['status']}" for s in steps]
                ok = all(i["status"] == "done" for i in incidents)
                record.result = "acted" if ok else "action failed"
                self.say(f"bridge: {', '.join(record.actions)}")
                return
            time.sleep(1)
        record.result = "no action"
        self.say(f"bridge did not finish {record.fault.action} within {timeout:.0f}s")

    def play(self, warmup_steps: int = 30, gap_steps: int = 10) -> list[FaultRecord]:
        self.say("warm-up: healthy training")
        self.wait_for_steps(warmup_steps, timeout=180)
        for fault in FAULTS:
            record = self.inject(fault)
            self.detect(record)
            self.clear()  # a hung rank stays hung; the others heal
            self.await_actions(record)
            if not fault.stops_training:
                self.wait_for_steps(gap_steps, timeout=120)
        return self.records

    def wait_for_resume(self, timeout: float = 180.0) -> int | None:
        """After the hang's restart: the step the job resumed from, once it trains again."""
        log = self.stack.logs / f"{RUN}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace") if log.exists() else ""
            resumed = [line for line in text.splitlines() if "resumed from checkpoint" in line]
            if resumed:
                step = int(resumed[-1].rsplit(" ", 1)[-1])
                self.wait_for_steps(3, timeout=max(10.0, deadline - time.monotonic()))
                self.say(f"job resumed from its checkpoint at step {step} and trains again")
                return step
            time.sleep(1)
        return None

    def wait_for_ledger(self, timeout: float = 90.0) -> bool:
        """Wait until every incident in the bridge's ledger is final (for a restart: recovered,
        with its lost steps, once the bridge saw a step after it); False when `timeout` passed
        first (the report then shows what is known)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(*QUERY_ERRORS):
                entries = self.stack.incidents()
                if entries and all(e.get("final") for e in entries):
                    return True
            time.sleep(1)
        self.say(f"the incident ledger was not final after {timeout:.0f}s")
        return False
