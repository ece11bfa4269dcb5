"""`robust-metrics bridge --config bridge.yaml`: validate the policy, then serve the webhook."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["configure", "configure_logging", "run"]


class _RequestsAtDebug(logging.Filter):
    """httpx logs every request it sends at INFO (`HTTP Request: GET .../api/v1/query ...`): the
    ledger's Prometheus reads every `incidents.poll`, the stop notice's four a second during a
    restart, hundreds of lines an hour that say nothing happened. They become DEBUG records, shown
    only at `--log-level debug`; what changed (a step's outcome, a recovery note, a warning) is
    logged by the bridge itself at INFO and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def configure_logging(level: str) -> None:
    """The bridge's log: `level` for its own records, routine HTTP requests at DEBUG."""
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    requests = logging.getLogger("httpx")
    if not any(isinstance(f, _RequestsAtDebug) for f in requests.filters):
        requests.addFilter(_RequestsAtDebug())


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="policy YAML (see docs/bridge.md and examples/bridge.yaml)")
    parser.add_argument("--host", default=None,
                        help="listen address (overrides listen.host; default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="listen port (overrides listen.port; default 9095)")
    parser.add_argument("--database", default=None,
                        help="SQLite action log (overrides `database`)")
    parser.add_argument("--dry-run", action="store_true",
                        help="record what every action would do, do nothing")
    parser.add_argument("--check", action="store_true",
                        help="validate the policy file and exit (0 when valid)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="info: what the bridge decided and did; debug adds every HTTP "
                        "request it sends (Prometheus polls) and the access log")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from robust_metrics.bridge.config import ConfigError, load

    configure_logging(args.log_level)
    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"robust-metrics bridge: invalid policy: {exc}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                   ("database", args.database)) if v is not None}
    if args.dry_run:
        overrides["dry_run"] = True
    config = dataclasses.replace(config, **overrides)
    try:
        from robust_metrics.bridge.schedulers import base

        for s in config.schedulers.values():
            s.create()
    except (ConfigError, base.SchedulerError) as exc:
        print(f"robust-metrics bridge: invalid scheduler config: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: valid ({len(config.rules)} rules, schedulers: "
              f"{', '.join(config.schedulers) or 'none'})")
        return 0

    import uvicorn

    from robust_metrics.bridge.app import create_app
    from robust_metrics.bridge.service import Bridge
    from robust_metrics.bridge.store import ActionLogError

    try:
        bridge = Bridge(config)
    except ActionLogError as exc:
        print(f"robust-metrics bridge: {exc}", file=sys.stderr)
        return 2
    app = create_app(bridge)
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                access_log=args.log_level == "debug")
    return 0
