"""`robust-metrics job start|stop|status --config BRIDGE_YAML [--scheduler NAME] RUN`.

The bridge restarts a run under the `local` scheduler only when it knows the run's process: the
adapter keeps each run's pid, start time and last operation in its state folder, and a job
started by hand has no entry there ("run 'X' was never started by this bridge; nothing to
restart"). This command starts, stops and shows a run through the very adapter the bridge builds
from the same policy file (`SchedulerConfig.create`: same command, cwd, env, state and log
folders, relative paths against the policy file's folder), so the bridge can restart or stop a
run started here, and a run the bridge restarted can be stopped here. Both sides hold the run's
lock in the state folder while they change it.

Exit status: 0 done (`status`: the run is running); 1 the scheduler failed (the command cannot
be started, its state is unreadable); 2 bad input (no or invalid policy, no such scheduler, a
scheduler that is not `local`); 3 from `status` when the run is not running.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["configure", "run"]

NOT_RUNNING = 3  # as `systemctl status` and LSB init scripts say "not running"

_ACTIONS = {
    "start": "start the run's command unless it is running (the bridge can then restart it)",
    "stop": "stop the run's process group: SIGTERM, then SIGKILL after stop_timeout_s",
    "status": "show the run's process; exit 0 when it is running, 3 when it is not",
}


class _Refused(Exception):
    """Bad input: the message is printed and the command exits 2."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Start, stop or show a training job under the bridge's `local` "
                          "scheduler, with the state the bridge uses, so that the bridge can "
                          "restart it (docs/bridge.md, 'Starting a job the bridge can restart').")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in _ACTIONS.items():
        sub = actions.add_parser(name, help=text, description=text)
        sub.add_argument("--config", required=True, metavar="BRIDGE_YAML",
                         help="the bridge's policy file (the one `robust-metrics bridge` reads)")
        sub.add_argument("--scheduler", metavar="NAME", default=None,
                         help="the scheduler of type local in that file (default: the only one)")
        sub.add_argument("run", metavar="RUN",
                         help="the run: the `run` label of its alerts, `{run}` in the command")


def _scheduler(config_path: str, name: str | None) -> tuple[str, Any]:
    """The named (or only) `local` scheduler of the policy, built as the bridge builds it."""
    from robust_metrics.bridge.config import ConfigError, load
    from robust_metrics.bridge.schedulers.base import SchedulerError

    try:
        config = load(config_path)
    except ConfigError as exc:
        raise _Refused(f"invalid policy: {exc}") from None
    local = sorted(n for n, s in config.schedulers.items() if s.type == "local")
    if name is None:
        if len(local) != 1:
            which = (f"it has {len(local)}: {', '.join(local)}; choose one with --scheduler"
                     if local else "it has none")
            raise _Refused(f"{config_path}: needs exactly one scheduler of type local, {which}")
        name = local[0]
    elif name not in config.schedulers:
        raise _Refused(f"{config_path}: no scheduler named {name!r} (defined: "
                       f"{', '.join(sorted(config.schedulers)) or 'none'})")
    elif config.schedulers[name].type != "local":
        raise _Refused(f"{config_path}: scheduler {name!r} is of type "
                       f"{config.schedulers[name].type}, not local; start its jobs through that "
                       "scheduler (the bridge restarts them there)")
    try:
        return name, config.schedulers[name].create()
    except (ConfigError, SchedulerError) as exc:
        raise _Refused(f"{config_path}: scheduler {name!r}: {exc}") from None


def _status(scheduler: Any, name: str, run: str) -> int:
    state = scheduler.state(run)
    if not state:
        print(f"run {run}: never started through scheduler {name} (no state in "
              f"{scheduler.state_dir})")
        return NOT_RUNNING
    started = state.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    facts = (f"generation {state.get('generation', 0)}, started {when} ({state.get('reason')}), "
             f"log {scheduler.log_path(run)}")
    if scheduler.running(run):
        print(f"run {run}: running as pid {state['pid']} ({facts})")
        return 0
    print(f"run {run}: not running ({facts})")
    return NOT_RUNNING


def run(args: argparse.Namespace) -> int:
    from robust_metrics.bridge.schedulers.base import SchedulerError

    prog = f"robust-metrics job {args.action}"
    try:
        if not args.run.strip():
            raise _Refused("RUN must not be empty")
        name, scheduler = _scheduler(args.config, args.scheduler)
    except _Refused as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.action == "status":
            return _status(scheduler, name, args.run)
        if args.action == "start":
            result = scheduler.start(args.run, reason="robust-metrics job start")
            print(f"{result.detail}; log {scheduler.log_path(args.run)}")
        else:
            result = scheduler.cancel(args.run, "robust-metrics job stop")
            print(result.detail)
    except (SchedulerError, OSError) as exc:  # OSError: a state or log folder we cannot write
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    finally:
        scheduler.close()
    return 0 if result.ok else 1
