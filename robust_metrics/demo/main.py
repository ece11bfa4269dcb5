"""`robust-metrics demo`: a training job gets into trouble; robust-metrics catches it and acts.

On loopback ports it starts Prometheus and Alertmanager (configs generated from the shipped rules
and routing), the node sidecar, the action bridge with the `local` scheduler, and a 4-rank gloo job
training a small transformer with the hook. A fault script then plays: healthy warm-up, one rank
slowed, a NaN loss, one rank hung. At the end: a summary table, ETTR, and a report folder with
plots. Ctrl-C stops every process it started.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from robust_metrics.demo.report import summary_table, write_report
from robust_metrics.demo.scenario import Scenario
from robust_metrics.demo.stack import RUN, DemoStack


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=300.0,
                        help="time budget in seconds; with --no-faults, how long to train "
                             "(default 300)")
    parser.add_argument("--no-faults", action="store_true",
                        help="train healthily for --duration and check that nothing fires")
    parser.add_argument("--keep-running", action="store_true",
                        help="leave everything running after the script, until Ctrl-C")
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--out", default="demo-run",
                        help="folder for configs, logs and the report (default demo-run/<time>)")
    parser.add_argument("--step-sleep", type=float, default=0.05,
                        help="extra seconds per training step (default 0.05)")


class StatusPrinter:
    """Prints a status line every few seconds: step, firing alerts, bridge incidents."""

    def __init__(self, stack: DemoStack, interval: float = 5.0) -> None:
        self.stack = stack
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def line(self) -> str:
        try:
            steps = self.stack.query(f'max(robust_global_step{{run="{RUN}"}})')
            step = int(float(steps[0]["value"][1])) if steps else 0
            alerts = sorted({f"{a['labels']['alertname']}"
                             + (f"(rank {a['labels']['rank']})" if "rank" in a["labels"] else "")
                             for a in self.stack.firing_alerts()})
            incidents = self.stack.actions()
            done = sum(1 for i in incidents if i.get("status") == "done")
        except Exception as exc:  # a service restarting; say so and go on
            return f"status unavailable: {exc}"
        return (f"step {step:5d} | firing: {', '.join(alerts) or 'none'} | "
                f"bridge incidents: {len(incidents)} ({done} done)")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            say(self.line())


def say(text: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        print("demo: --ranks must be >= 2 (a straggler needs peers)", file=sys.stderr)
        return 2
    folder = Path(args.out) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stack = DemoStack(folder.resolve(), ranks=args.ranks, step_sleep=args.step_sleep)

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    status = StatusPrinter(stack)
    try:
        say(f"starting Prometheus, Alertmanager, sidecar and bridge; run folder {folder}")
        stack.start()
        say(f"Prometheus {stack.url['prometheus']}  Alertmanager {stack.url['alertmanager']}  "
            f"sidecar {stack.url['sidecar']}  bridge {stack.url['bridge']}")
        stack.start_job()
        say(f"training job started: {args.ranks} gloo ranks (log: {stack.logs / (RUN + '.log')})")
        status.start()
        started = time.time()
        scenario = Scenario(stack, on_event=say,
                            detect_timeout=max(60.0, args.duration / 3))
        resumed = None
        if args.no_faults:
            scenario.wait_for_steps(10, timeout=180)
            time.sleep(max(0.0, args.duration - (time.time() - started)))
            firing = [a["labels"]["alertname"] for a in stack.firing_alerts()]
            say(f"healthy run finished; alerts firing: {', '.join(firing) or 'none'}")
        else:
            scenario.play()
            resumed = scenario.wait_for_resume()
        status.stop()
        page = write_report(stack, scenario.records, started, time.time(), folder / "report",
                            resumed)
        print()
        if scenario.records:
            print(summary_table(scenario.records))
        print(f"\nreport: {page}")
        if args.keep_running:
            say("everything keeps running; Ctrl-C to stop")
            while True:
                time.sleep(3600)
        missed = [r for r in scenario.records if r.detected_at is None or
                  r.alert_rank != str(r.fault.rank)]
        return 1 if missed else 0
    except KeyboardInterrupt:
        say("interrupted; stopping everything")
        return 130
    finally:
        status.stop()
        stack.stop()
