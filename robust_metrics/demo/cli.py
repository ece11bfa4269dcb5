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
import time
from pathlib import Path
from types import FrameType

from robust_metrics.demo.console import make_console
from robust_metrics.demo.report import summary_table, write_report
from robust_metrics.demo.scenario import Scenario, problems
from robust_metrics.demo.stack import RUN, DemoStack
from robust_metrics.processes import ServiceError


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
    parser.add_argument("--plain", action="store_true",
                        help="print status lines instead of the live view (the default when the "
                             "output is not a terminal)")


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        print("demo: --ranks must be >= 2 (a straggler needs peers)", file=sys.stderr)
        return 2
    folder = Path(args.out) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stack = DemoStack(folder.resolve(), ranks=args.ranks, step_sleep=args.step_sleep)

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    console = make_console(stack, live=sys.stdout.isatty() and not args.plain)
    say = console.event
    try:
        say(f"starting Prometheus, Alertmanager, sidecar and bridge; run folder {folder}")
        stack.start()
        say(f"Prometheus {stack.url['prometheus']}  Alertmanager {stack.url['alertmanager']}  "
            f"sidecar {stack.url['sidecar']}  bridge {stack.url['bridge']}")
        stack.start_job()
        say(f"training job started: {args.ranks} gloo ranks (log: {stack.logs / (RUN + '.log')})")
        console.start()
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
            scenario.wait_for_ledger()
        console.stop()
        report = write_report(stack, scenario.records, started, time.time(),
                              folder / "report", resumed)
        print()
        if scenario.records:
            print(summary_table(scenario.records))
        print(f"\nreport: {report.page}")
        if args.keep_running:
            say("everything keeps running; Ctrl-C to stop")
            while True:
                time.sleep(3600)
        healthy = sorted({a.get("alertname", "") for a in report.alerts_fired or []}) \
            if args.no_faults else None
        failed = problems(scenario.records, resumed_from=resumed,
                          healthy_alerts=healthy) + report.errors
        for problem in failed:
            print(f"demo: FAILED: {problem}", file=sys.stderr)
        return 1 if failed else 0
    except (ServiceError, TimeoutError) as exc:
        say(f"demo: FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; stopping everything")
        return 130
    finally:
        console.stop()
        stack.stop()
