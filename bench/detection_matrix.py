"""Detection matrix: per fault, the right alert, the right rank, the latency, the false alerts.

    .venv/bin/python bench/detection_matrix.py [--trials 3] [--faults kill9,stall,...]
        [--healthy-seconds 240] [--out results.json]

Real parts only: a 4-rank gloo job (robust_metrics/workloads/fault_job.py: an MLP with Adam
under DDP and one `watch()` line) writing to a multiprocess folder, a real `robust-metrics
sidecar` serving it (with a copy of the sysfs fixture as its /sys, so a NIC flap can be
injected), a real Prometheus scraping the sidecar and evaluating the shipped rules every second,
rescaled by 1/15 (`robust-metrics rules --time-scale`), the ratio of these intervals to the 15 s
defaults.

Every trial is one run id. A positive trial waits until the four ranks step, injects its fault
(in the job: the faulty rank prints `FAULT <unix time>`; from outside: the time of the signal), then
polls Prometheus' alerts every 0.25 s until the expected alert fires with the expected rank, and
keeps watching for 3 s more. A negative trial (a healthy run with checkpoint and eval phases, a
normal end) watches for the whole run and 5 s after it. Every firing alert of the run (and every
node-level alert) is classified: expected, an accepted companion (TrainingHang beside RankHang,
StragglerSlowdownHigh beside SlowRank, ...) or false. Precision = alerts that were right / all
firing alerts; recall = positive trials whose expected alert fired (with the right rank where the
alert names one) / positive trials. Latencies here are at 1 s intervals; `FORMULAS` gives them at
the 15 s defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from robust_metrics import rules  # noqa: E402
from robust_metrics.bridge.schedulers.local import LocalScheduler  # noqa: E402
from robust_metrics.processes import (  # noqa: E402
    Prometheus,
    RankJob,
    free_port,
    sidecar,
    wait_for,
)
from robust_metrics.processes import bridge as bridge_service  # noqa: E402
from robust_metrics.workloads import FAULT_JOB  # noqa: E402

WORLD = 4
NODE = "node-a"
JOB = FAULT_JOB
FAULT_STEP = 150  # in-job faults start here: after the spike detector's warmup and a SlowRank baseline
CONTENDERS = 4  # busy processes beside the contended rank, each its own session: 1/5 of the CPU each


@dataclass
class Fault:
    """One fault type: the job's options, the alert expected, the rank it must name."""

    name: str
    args: list[str]
    expected: str | None  # None: a negative (nothing may fire)
    rank: int | None = None  # the rank the alert must name; None: a run- or node-level alert
    companions: frozenset[str] = frozenset()
    inject: str = "job"  # job (the job prints FAULT), kill9, sigstop, nic, contention, none
    formula: str = ""
    timeout: float = 60.0
    steps_first: int = 20  # steps every rank makes before the fault (0: the fault comes first)
    stall_factor: float = 0.0  # sigstop: SIGCONT after this many hang thresholds (0: never)

    def expects(self, labels: dict[str, str]) -> bool:
        """Whether an alert with these labels is the one this fault must raise."""
        return labels["alertname"] == self.expected and (
            self.rank is None or labels.get("rank") == str(self.rank))


HANG = frozenset({"TrainingHang"})
SLOW = frozenset({"StragglerSlowdownHigh", "ThroughputDrop"})
SLOW_FORMULA = "60 s x 0.2 / (R - 1) + 45 s + ≤ 15 s + ≤ 15 s"
STAT_FORMULA = "≈ 240-255 s (z-test held 75% of 3 min) + ≤ 15 s + ≤ 15 s"


def faults(healthy_seconds: float) -> list[Fault]:
    step = str(FAULT_STEP)
    checkpoints, evals = 10, 5
    return [
        Fault("healthy-1h", ["--duration", str(healthy_seconds), "--checkpoints", str(checkpoints),
                             "--evals", str(evals), "--checkpoint-seconds", "3",
                             "--eval-seconds", "3", "--shutdown-seconds", "3"],
              None, inject="none", formula="nothing", timeout=healthy_seconds + 120),
        Fault("normal-end", ["--steps", "300", "--shutdown-seconds", "3"], None, inject="none",
              formula="nothing"),
        # without a launcher to stop them, the peers hang in their next all-reduce: a true hang
        Fault("kill9", [], "RankExited", 2, frozenset({"TrainingHang", "RankHang(rank 2)"}),
              inject="kill9", formula="≤ 15 s + ≤ 15 s"),
        Fault("late-first-step", ["--first-step-delay-rank", "1", "--first-step-delay", "20"],
              "RankHang", 1, HANG, formula="30 s + ≤ 15 s + ≤ 15 s", steps_first=0),
        Fault("stop-in-collective", ["--stop-rank", "3", "--stop-step", step], "RankHang", 3,
              HANG, formula="20 s + 2 scrapes + ≤ 15 s"),
        Fault("sigstop-random", [], "RankHang", 2, HANG, inject="sigstop",
              formula="20 s + ≤ 15 s + ≤ 15 s (stopped in a collective: 20 s + 2 scrapes + ≤ 15 s)"),
        # Transitions: a fault that ends, and stops that are no crash. After the end (or the
        # stop) nothing may start firing, least of all an alert with an action.
        Fault("stall-ends-1.5x", [], None, 2, HANG | {"RankHang(rank 2)"}, inject="sigstop",
              formula="nothing after it ends", stall_factor=1.5),
        Fault("stall-ends-3x", [], "RankHang", 2, HANG, inject="sigstop",
              formula="20 s + 2 scrapes + ≤ 15 s; nothing after it ends",
              stall_factor=3.0),
        Fault("late-start-trains", ["--first-step-delay-rank", "1", "--first-step-delay", "20"],
              "RankHang", 1, HANG, inject="late", steps_first=0,
              formula="30 s + ≤ 15 s + ≤ 15 s; nothing after it steps"),
        Fault("scheduler-cancel", [], None, inject="cancel", formula="nothing"),
        Fault("scheduler-requeue", [], None, inject="requeue", formula="nothing"),
        Fault("bridge-restart", [], None, inject="bridge", formula="nothing"),
        *[Fault(f"slow-{factor}x-{where}", ["--slow-rank", "1", "--slow-factor", factor,
                                             "--slow-where", where, "--slow-step", step,
                                             "--compute", "0.1"],
                "SlowRank", 1, SLOW, formula=SLOW_FORMULA)
          for factor in ("1.3", "2") for where in ("forward", "backward")],
        # the study's threshold: 1.1x and 1.2x named by the statistical test, 1.05x recorded
        # (its z) but never alerted, for 80 s (20 minutes at the defaults)
        *[Fault(f"slow-{factor}x-forward", ["--slow-rank", "1", "--slow-factor", factor,
                                             "--slow-where", "forward", "--slow-step", step,
                                             "--compute", "0.1"],
                "SlowRank", 1, SLOW, formula=STAT_FORMULA, timeout=90)
          for factor in ("1.1", "1.2")],
        Fault("slow-1.05x-forward", ["--slow-rank", "1", "--slow-factor", "1.05",
                                     "--slow-where", "forward", "--slow-step", step,
                                     "--compute", "0.1", "--duration", "80",
                                     "--shutdown-seconds", "3"],
              None, inject="none", formula="nothing (recorded, not alerted)", timeout=140),
        Fault("data-stall", ["--stall-step", step, "--stall-seconds", "8"], "TrainingHang", None,
              frozenset({"ThroughputDrop"}), formula="20 s + ≤ 15 s + ≤ 15 s"),
        Fault("gc-storm", ["--gc-rank", "2", "--slow-step", step, "--compute", "0.1"],
              "SlowRank", 2, SLOW, formula=SLOW_FORMULA),
        Fault("cpu-contention", ["--work", "200", "--compute", "0.005"], "SlowRank", 3, SLOW,
              inject="contention", formula=SLOW_FORMULA),
        Fault("nan-loss", ["--nan-loss-rank", "1", "--nan-step", step], "NonFiniteLoss", 1,
              frozenset({"NonFiniteGradients"}), formula="≤ 15 s + ≤ 15 s"),
        Fault("nan-grad", ["--nan-grad-rank", "3", "--nan-step", step], "NonFiniteGradients",
              None, formula="≤ 15 s + ≤ 15 s"),
        Fault("loss-spike", ["--loss-spike-step", step], "LossSpike", None,
              frozenset({"GradNormSpike"}), formula="≤ 15 s + ≤ 15 s"),
        Fault("grad-norm-spike", ["--grad-spike-step", step], "GradNormSpike", None,
              formula="≤ 15 s + ≤ 15 s"),
        Fault("nic-flap", [], "NICFlapping", None, inject="nic", formula="≤ 15 s + ≤ 15 s"),
    ]


@dataclass
class Trial:
    fault: str
    trial: int
    detected: bool = False
    right_rank: bool | None = None
    latency_s: float | None = None
    true_alerts: list[str] = field(default_factory=list)
    false_alerts: list[str] = field(default_factory=list)
    note: str = ""
    ended_at: float | None = None  # when a transition's fault ended or its stop was issued


AFTER_END_S = 2.5  # one scrape, one evaluation and a poll: an alert first seen later is false


class Bench:
    def __init__(self, folder: Path, prom: Prometheus, metrics: Path, sysfs: Path,
                 bridge: MatrixBridge | None = None, interval_s: float = 1.0) -> None:
        self.folder, self.prom, self.metrics, self.sysfs = folder, prom, metrics, sysfs
        self.bridge = bridge
        # every wait of the bench is in scrape intervals: 1 s here, 15 s at the defaults
        self.k = interval_s
        self.after_end = AFTER_END_S * interval_s

    # -- observing -------------------------------------------------------------------------
    def firing(self, run: str) -> list[dict[str, Any]]:
        """Firing alerts of the run, and node-level alerts (no run label) of the node."""
        return [a for a in self.prom.api("alerts")["alerts"] if a["state"] == "firing"
                and (a["labels"].get("run") == run
                     or ("run" not in a["labels"] and a["labels"].get("node") == NODE))]

    def wait_stepping(self, run: str, job: RankJob | None, steps: int = 20,
                      fresh: float = 0.0) -> None:
        """Until every rank of the run made `steps` steps (with `fresh`: a step after then)."""
        query = (f'count(robust_steps_total{{run="{run}"}} > {steps})' if not fresh else
                 f'count(robust_last_step_timestamp_seconds{{run="{run}"}} > {fresh})')
        def stepping() -> bool:
            result = self.prom.query(query)
            return bool(result) and float(result[0]["value"][1]) == WORLD
        try:
            wait_for(stepping, timeout=120 * max(1.0, self.k / 4), interval=0.5,
                     message=f"{run} stepping")
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{job.logs() if job else ''}") from None

    @staticmethod
    def fault_time(job: RankJob, timeout: float) -> float:
        def found() -> float | None:
            for rank in range(WORLD):
                path = job.log_dir / f"rank{rank}.log"  # type: ignore[operator]
                match = re.search(r"^FAULT (\d+\.\d+)", path.read_text(errors="replace"), re.M)
                if match:
                    return float(match.group(1))
            return None
        return wait_for(found, timeout=timeout, interval=0.1, message="the job's FAULT line")

    def hang_threshold(self, run: str) -> float:
        result = self.prom.query(f'run:robust_step_duration_seconds:hang_threshold{{run="{run}"}}')
        return float(result[0]["value"][1]) if result else 2.0

    def watch(self, run: str, seen: dict[str, dict[str, Any]], until: float) -> None:
        """Poll the run's firing alerts until `until`, keeping when each was first seen."""
        while time.time() < until:
            now = time.time()
            for alert in self.firing(run):
                seen.setdefault(json.dumps(alert["labels"], sort_keys=True),
                                {**alert, "first_seen": now})
            time.sleep(0.25)

    # -- a trial ---------------------------------------------------------------------------
    def run_trial(self, fault: Fault, trial: int) -> Trial:
        run = f"{fault.name}-{trial}"
        logs = self.folder / f"logs-{run}"
        logs.mkdir()
        result = Trial(fault.name, trial)
        seen: dict[str, dict[str, Any]] = {}
        if fault.inject in ("cancel", "requeue", "bridge"):
            try:
                self._stop_trial(fault, run, logs, result, seen)
            except Exception as exc:
                result.note = f"error: {exc}"[:300]
            self._classify(fault, seen, result)
            return result
        job = RankJob(WORLD, fault.args, script=JOB, log_dir=logs, run=run,
                      env={"ROBUST_METRICS_DIR": str(self.metrics), "ROBUST_METRICS_NODE": NODE})
        cleanup: list[Callable[[], None]] = []
        try:
            if fault.steps_first:
                self.wait_stepping(run, job, fault.steps_first)
                if self.k > 1:  # the step-time medians need a few scrapes of history
                    time.sleep(4 * self.k)
            if fault.stall_factor:
                self._stall_that_ends(run, job, fault, result, seen)
            elif fault.inject == "late":
                self._late_start(run, job, fault, result, seen)
            elif fault.expected is None:
                self._watch_negative(run, job, fault, seen)
            else:
                t0 = self._inject(fault, job, cleanup)
                self._watch_positive(run, fault, t0, result, seen)
        except Exception as exc:  # a trial that breaks is reported, not hidden
            result.note = f"error: {exc}"[:300]
        finally:
            for undo in reversed(cleanup):
                with contextlib.suppress(Exception):
                    undo()
            job.kill()
        if fault.inject == "nic":  # node-level: let it resolve before the next trial
            with contextlib.suppress(TimeoutError):
                wait_for(lambda: not self.firing("-"), timeout=60, interval=1,
                         message="node alerts resolved")
        self._classify(fault, seen, result)
        return result

    def _inject(self, fault: Fault, job: RankJob, cleanup: list[Callable[[], None]]) -> float:
        if fault.inject == "job":
            return self.fault_time(job, timeout=120)
        time.sleep(random.uniform(0.5, 2.0))  # a random moment of the step
        if fault.inject == "kill9":
            os.kill(job.pids[fault.rank], signal.SIGKILL)  # type: ignore[index]
        elif fault.inject == "sigstop":
            pid = job.pids[fault.rank]  # type: ignore[index]
            os.kill(pid, signal.SIGSTOP)
            cleanup.append(lambda: os.kill(pid, signal.SIGCONT))
        elif fault.inject == "nic":
            self._flap_nic()
        elif fault.inject == "contention":
            cleanup.extend(self._contend(job, fault.rank))  # type: ignore[arg-type]
        return time.time()

    def _stall_that_ends(self, run: str, job: RankJob, fault: Fault, result: Trial,
                         seen: dict[str, dict[str, Any]]) -> None:
        """SIGSTOP a rank at a random moment, SIGCONT it after `stall_factor` hang thresholds,
        then keep watching while the run trains on."""
        stall = fault.stall_factor * self.hang_threshold(run)
        time.sleep(random.uniform(0.5, 2.0))
        pid = job.pids[fault.rank]  # type: ignore[index]
        os.kill(pid, signal.SIGSTOP)
        t0 = time.time()
        try:
            self.watch(run, seen, t0 + stall)
        finally:
            os.kill(pid, signal.SIGCONT)
        result.ended_at = time.time()
        self._detected(fault, seen, t0, result, before=result.ended_at + self.after_end)
        self.watch(run, seen, result.ended_at + 15 * self.k)

    def _late_start(self, run: str, job: RankJob, fault: Fault, result: Trial,
                    seen: dict[str, dict[str, Any]]) -> None:
        """A rank whose first step comes late: named while it is late, then the run trains."""
        t0 = time.time()
        def all_step() -> bool:
            self.watch(run, seen, time.time() + 0.5)
            got = self.prom.query(f'count(robust_steps_total{{run="{run}"}} > 0)')
            return bool(got) and float(got[0]["value"][1]) == WORLD
        wait_for(all_step, timeout=(fault.timeout + 60) * self.k, interval=0.1,
                 message="late rank steps")
        result.ended_at = time.time()
        self._detected(fault, seen, t0, result, before=result.ended_at + self.after_end)
        self.watch(run, seen, result.ended_at + 15 * self.k)

    @staticmethod
    def _detected(fault: Fault, seen: dict[str, dict[str, Any]], t0: float, result: Trial,
                  before: float) -> None:
        hits = [a["first_seen"] for a in seen.values()
                if fault.expects(a["labels"]) and a["first_seen"] <= before]
        if hits:
            result.detected, result.latency_s = True, round(min(hits) - t0, 2)

    def _stop_trial(self, fault: Fault, run: str, logs: Path, result: Trial,
                    seen: dict[str, dict[str, Any]]) -> None:
        """Stops that are no crash: the scheduler cancels the job (SIGTERM to every rank at
        once, reaped at once), requeues it (the same, then the run starts again), or the bridge
        restarts it. The first two go through plain ranks, the last through torchrun under the
        bridge's `local` scheduler."""
        if fault.inject == "bridge":
            assert self.bridge is not None, "the bridge trial needs the matrix's bridge"
            self.bridge.start_job(run)
            try:
                self.wait_stepping(run, None)
                result.ended_at = time.time()
                self.bridge.restart(run)
                self.watch(run, seen, time.time() + 8)
                self.wait_stepping(run, None, steps=1, fresh=result.ended_at)
                self.watch(run, seen, time.time() + 10)
            finally:
                self.bridge.cancel(run)
            return
        env = {"ROBUST_METRICS_DIR": str(self.metrics), "ROBUST_METRICS_NODE": NODE}
        job = RankJob(WORLD, [], script=JOB, log_dir=logs, run=run, env=env)
        again: RankJob | None = None
        try:
            self.wait_stepping(run, job)
            result.ended_at = time.time()
            for proc in job.procs:
                proc.terminate()
            for proc in job.procs:
                proc.wait(timeout=30)
            self.watch(run, seen, time.time() + 5)
            if fault.inject == "requeue":
                (logs / "requeued").mkdir()
                again = RankJob(WORLD, [], script=JOB, log_dir=logs / "requeued", run=run,
                                env=env)
                self.wait_stepping(run, again, steps=1, fresh=result.ended_at)
            self.watch(run, seen, time.time() + 10)
        finally:
            job.kill()
            if again is not None:
                again.kill()

    def _flap_nic(self) -> None:
        """Two flaps of eth1 in the sysfs copy: carrier down and up twice (4 changes)."""
        net = self.sysfs / "class" / "net" / "eth1"
        for carrier in ("0", "1", "0", "1"):
            changes = int((net / "carrier_changes").read_text()) + 1
            (net / "carrier").write_text(carrier + "\n")
            (net / "carrier_changes").write_text(f"{changes}\n")
            time.sleep(0.3)

    @staticmethod
    def _contend(job: RankJob, rank: int) -> list[Callable[[], None]]:
        """Crowd one rank's CPU: pin it to CPU 0 with `CONTENDERS` busy processes, its peers to
        the other CPUs (on 2 cores four ranks already share the cores; without moving the peers
        away every rank would be slowed alike). Each busy process is its own session, as an
        unrelated process on a node is: with autogroup scheduling the kernel shares a CPU
        between sessions first, so hogs in one session would take only half of it."""
        everything = os.sched_getaffinity(0)
        crowded, others = {0}, (everything - {0}) or everything
        for other, pid in enumerate(job.pids):
            os.sched_setaffinity(pid, crowded if other == rank else others)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 preexec_fn=lambda: os.sched_setaffinity(0, crowded),
                                 start_new_session=True)
                for _ in range(CONTENDERS)]
        return [lambda h=h: (h.kill(), h.wait()) for h in hogs]  # type: ignore[misc]

    def _watch_positive(self, run: str, fault: Fault, t0: float, result: Trial,
                        seen: dict[str, dict[str, Any]]) -> None:
        deadline = time.time() + fault.timeout * self.k
        while time.time() < deadline and not result.detected:
            self.watch(run, seen, time.time() + 0.25)
            self._detected(fault, seen, t0, result, before=float("inf"))
        if result.detected:
            self.watch(run, seen, time.time() + 3 * self.k)  # the companions that follow

    def _watch_negative(self, run: str, job: RankJob, fault: Fault,
                        seen: dict[str, dict[str, Any]]) -> None:
        deadline = time.time() + fault.timeout * self.k
        ended = None
        while time.time() < deadline and (ended is None or time.time() < ended + 5 * self.k):
            self.watch(run, seen, time.time() + 0.25)
            if ended is None and all(p.poll() is not None for p in job.procs):
                ended = time.time()
        if ended is None:
            raise RuntimeError("the job did not end in time")

    def _classify(self, fault: Fault, seen: dict[str, dict[str, Any]], result: Trial) -> None:
        for alert in seen.values():
            labels = alert["labels"]
            name = labels["alertname"]
            tag = name + (f"(rank {labels['rank']})" if "rank" in labels else "")
            right = fault.expects(labels)
            late = (result.ended_at is not None
                    and alert.get("first_seen", 0.0) > result.ended_at + self.after_end)
            if late:
                result.false_alerts.append(f"{tag} after the end")
            elif right or name in fault.companions or tag in fault.companions:
                result.true_alerts.append(tag)
            else:
                result.false_alerts.append(tag)
        if fault.expected is not None and fault.rank is not None:
            result.right_rank = result.detected


class MatrixBridge:
    """A real bridge whose `local` scheduler runs the fault job under torchrun, and restarts it
    when told to by an authenticated webhook (an Alertmanager payload of one alert)."""

    ALERT = "MatrixRestart"

    def __init__(self, folder: Path, metrics: Path, prometheus_url: str, port: int) -> None:
        self.folder, self.port = folder, port
        self.token = secrets.token_urlsafe(24)
        token_file = folder / "bridge-token"
        token_file.write_text(self.token)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={WORLD}", str(JOB)]
        self.local = {"command": launcher, "cwd": str(folder),
                      "env": {"ROBUST_METRICS_DIR": str(metrics), "ROBUST_METRICS_NODE": NODE,
                              "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                      "state_dir": str(folder / "local-scheduler"),
                      "log_dir": str(folder / "bridge-logs"), "stop_timeout_s": 10}
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "database": str(folder / "bridge.db"),
            "auth": {"bearer_token_file": str(token_file)},
            "prometheus": {"url": prometheus_url},
            "schedulers": {"local": {"type": "local", **self.local}},
            "default_scheduler": "local",
            "restart_budget": {"max_restarts": 1000, "window": "1h"},
            "rules": [{"name": "restart", "match": {"alertname": self.ALERT},
                       "actions": ["restart"]}],
        }
        path = folder / "bridge.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.service = bridge_service(path, port=port, log_path=folder / "bridge.log")

    def scheduler(self) -> LocalScheduler:
        return LocalScheduler(dict(self.local))

    def start_job(self, run: str) -> None:
        started = self.scheduler().start(run, reason="detection matrix")
        if not started.ok:
            raise RuntimeError(started.detail)

    def cancel(self, run: str) -> None:
        self.scheduler().cancel(run, "detection matrix trial over")

    def restart(self, run: str) -> None:
        """Ask the bridge to restart `run`, and wait until its action is recorded done."""
        alert = {"status": "firing", "fingerprint": run,
                 "labels": {"alertname": self.ALERT, "run": run, "severity": "critical"},
                 "annotations": {}, "startsAt": datetime.datetime.now(datetime.UTC).isoformat(),
                 "endsAt": "0001-01-01T00:00:00Z", "generatorURL": ""}
        body = {"version": "4", "groupKey": run, "status": "firing", "receiver": "bridge",
                "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
                "externalURL": "", "truncatedAlerts": 0, "alerts": [alert]}
        headers = {"Authorization": f"Bearer {self.token}"}
        base = f"http://127.0.0.1:{self.port}/api/v1"
        httpx.post(f"{base}/alerts", json=body, headers=headers, timeout=10).raise_for_status()

        def restarted() -> bool:
            actions = httpx.get(f"{base}/actions", params={"run": run}, headers=headers,
                                timeout=10).json()
            actions = actions.get("actions", actions) if isinstance(actions, dict) else actions
            return any(s.get("action") == "restart" and s.get("status") in ("success", "failed")
                       for a in actions for s in a.get("steps", []))
        wait_for(restarted, timeout=90, interval=0.5, message=f"the bridge's restart of {run}")


def summarize(results: list[Trial], chosen: list[Fault]) -> dict[str, Any]:
    by_name = {f.name: f for f in chosen}
    positives = [r for r in results if by_name[r.fault].expected is not None]
    true = sum(len(r.true_alerts) for r in results)
    false = sum(len(r.false_alerts) for r in results)
    rows = []
    for fault in chosen:
        trials = [r for r in results if r.fault == fault.name]
        latencies = [r.latency_s for r in trials if r.latency_s is not None]
        rows.append({
            "fault": fault.name, "expected": fault.expected or "nothing",
            "rank": fault.rank, "trials": len(trials),
            "detected": sum(r.detected for r in trials) if fault.expected else None,
            "right_rank": (sum(bool(r.right_rank) for r in trials)
                           if fault.rank is not None and fault.expected else None),
            "latency_s": latencies,
            "false_alerts": sorted({a for r in trials for a in r.false_alerts}),
            "false_alert_count": sum(len(r.false_alerts) for r in trials),
            "notes": [r.note for r in trials if r.note],
            "formula_15s": fault.formula,
        })
    return {
        "rows": rows,
        "recall": (sum(r.detected for r in positives) / len(positives)) if positives else None,
        "precision": true / (true + false) if true + false else None,
        "alerts_true": true, "alerts_false": false,
        "trials": len(results),
    }


def markdown(summary: dict[str, Any]) -> str:
    interval = summary.get("interval_s", 1.0)
    lines = [f"| fault | expected alert | trials | detected | right rank | latency at {interval:g} s (s) "
             "| false alerts | formula at 15 s |", "|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        lat = ", ".join(f"{x:.1f}" for x in row["latency_s"]) or "-"
        rank = "-" if row["right_rank"] is None else f"{row['right_rank']}/{row['trials']}"
        detected = "-" if row["detected"] is None else f"{row['detected']}/{row['trials']}"
        expected = row["expected"] + (f" (rank {row['rank']})" if row["rank"] is not None else "")
        false = ", ".join(row["false_alerts"]) or "0"
        lines.append(f"| {row['fault']} | {expected} | {row['trials']} | {detected} | {rank} "
                     f"| {lat} | {false} | {row['formula_15s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    all_faults = faults(240)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--faults", default="all",
                   help="comma-separated: " + ", ".join(f.name for f in all_faults))
    p.add_argument("--healthy-seconds", type=float, default=240.0,
                   help="length of the healthy run (240 s at 1/15 = 1 hour at the defaults)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--interval", type=float, default=1.0,
                   help="scrape and evaluation interval in seconds; the rules are scaled by "
                        "interval / 15 s and every wait of the bench by the interval (15: the "
                        "defaults, unscaled)")
    p.add_argument("--keep", action="store_true",
                   help="keep the working folder (logs, configs, databases) and print its path")
    args = p.parse_args(argv)
    random.seed(args.seed)
    chosen = faults(args.healthy_seconds)
    if args.faults != "all":
        wanted = args.faults.split(",")
        unknown = set(wanted) - {f.name for f in chosen}
        if unknown:
            p.error(f"unknown faults: {', '.join(sorted(unknown))}")
        chosen = [f for f in chosen if f.name in wanted]
    folder = Path(tempfile.mkdtemp(prefix="detection-matrix-"))
    metrics, sysfs = folder / "metrics", folder / "sysfs"
    metrics.mkdir()
    shutil.copytree(ROOT / "tests" / "fixtures" / "sysfs", sysfs)
    net = sysfs / "class" / "net" / "eth1"
    (net / "carrier").write_text("1\n")  # up, so that the flap is a change
    if not 0 < args.interval <= 60:
        p.error(f"--interval {args.interval:g}: must be in (0, 60] seconds")
    rule_file = folder / f"rules-{args.interval:g}s.yml"
    rule_file.write_text(rules.render(rules.load_groups(time_scale=args.interval / 15)))
    # every rank started below keeps its step windows at the rules' time scale
    os.environ["ROBUST_METRICS_TIME_SCALE"] = repr(args.interval / 15)
    results: list[Trial] = []
    started = time.time()
    side = sidecar(metrics, ["--node", NODE, "--path.sysfs", str(sysfs)],
                   log_path=folder / "sidecar.log")
    prom_port, bridge_port = free_port(), free_port()
    matrix_bridge = MatrixBridge(folder, metrics, f"http://127.0.0.1:{prom_port}", bridge_port)
    with side, matrix_bridge.service, Prometheus(
            folder / "prometheus", [side.url.removeprefix("http://"), f"127.0.0.1:{bridge_port}"],
            rule_files=[rule_file], port=prom_port, scrape_interval=f"{args.interval:g}s",
            evaluation_interval=f"{args.interval:g}s") as prom:
        bench = Bench(folder, prom, metrics, sysfs, matrix_bridge, interval_s=args.interval)
        for trial in range(args.trials):
            for fault in chosen:
                result = bench.run_trial(fault, trial)
                results.append(result)
                print(json.dumps(result.__dict__), flush=True)
    summary = summarize(results, chosen)
    summary["wall_seconds"] = round(time.time() - started)
    summary["interval_s"] = args.interval
    summary["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(markdown(summary))
    print(f"precision {summary['precision']}, recall {summary['recall']}, "
          f"{summary['trials']} trials in {summary['wall_seconds']} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary,
                                              "trials": [r.__dict__ for r in results]}, indent=1))
    if args.keep:
        print(f"kept {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
