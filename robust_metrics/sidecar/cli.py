"""`robust-metrics sidecar`: the node exporter, one per node, scraped by Prometheus.

    robust-metrics sidecar --dir /run/robust-metrics --listen 127.0.0.1:9741 \\
        [--token-file FILE] [--web-config FILE] [--collector.NAME | --no-collector.NAME]

Exit status: SIGTERM/SIGINT shut it down cleanly, then it ends by that signal (as uvicorn does);
2 for bad configuration (flags, web config, token file, folder); 3 when the listen address cannot
be bound (port taken, address not local).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import socket
import sys

from robust_metrics.sidecar.collectors.registry import (
    Collector,
    ScrapeRegistry,
    add_collector_flags,
    available,
    enabled_names,
)
from robust_metrics.sidecar.config import DEFAULT_LISTEN, ConfigError, SidecarConfig, parse_listen

__all__ = ["EXIT_BIND", "EXIT_CONFIG", "build", "configure", "run"]

log = logging.getLogger("robust_metrics.sidecar")

EXIT_CONFIG = 2
EXIT_BIND = 3


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones (None) and the collector switches."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `robust-metrics sidecar` (docs/sidecar.md lists them all)."""
    parser.formatter_class = _HelpFormatter
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDR:PORT",
                        help="address to serve on; loopback by default, use 0.0.0.0:9741 (with "
                             "--token-file and --web-config) to let Prometheus on another host in")
    parser.add_argument("--dir", default=os.environ.get("ROBUST_METRICS_DIR"),
                        help="the ranks' multiprocess folder (ROBUST_METRICS_DIR of the ranks); "
                             "created when missing")
    parser.add_argument("--node", default=os.environ.get("ROBUST_METRICS_NODE")
                        or socket.gethostname(), help="value of the node label")
    parser.add_argument("--token-file", default=None,
                        help="file holding the bearer token for /debug and /control "
                             "(without it those endpoints are disabled)")
    parser.add_argument("--web-config", default=None,
                        help="TLS and basic auth settings, Prometheus exporter-toolkit format")
    parser.add_argument("--path.sysfs", dest="sysfs", default="/sys",
                        help="sysfs root read by the nic collector")
    parser.add_argument("--nccl-ras-addr", default=os.environ.get("NCCL_RAS_ADDR")
                        or "localhost:28028", help="NCCL RAS service address (NCCL_RAS_ADDR)")
    parser.add_argument("--nccl-interval", type=float, default=30.0,
                        help="seconds between NCCL RAS status queries")
    parser.add_argument("--merge-after", type=float, default=60.0,
                        help="seconds a dead rank's files must be unchanged before its counters "
                             "are merged into the archive and the files deleted")
    parser.add_argument("--retention", type=float, default=600.0,
                        help="seconds a finished run's archived counters and a dead rank's "
                             "identity are kept")
    parser.add_argument("--stacks-timeout", type=float, default=10.0,
                        help="default py-spy timeout per process for /debug/stacks")
    parser.add_argument("--nvml-retry", type=float, default=60.0,
                        help="seconds between NVML initialisation attempts while it fails")
    parser.add_argument("--gpu-peak-dtype", default="bf16",
                        help="precision of the peak FLOP/s published per GPU for MFU "
                             "(bf16, fp16, fp8, tf32, fp32; dense, no sparsity)")
    parser.add_argument("--gpu-peak-flops", action="append", default=[], metavar="NAME=FLOPS",
                        help="peak FLOP/s of GPUs whose NVML name contains NAME (* for all), "
                             "over the built-in table; repeatable")
    parser.add_argument("--collector-timeout", type=float, default=5.0,
                        help="seconds a scrape waits for a collector before reporting it failed "
                             "(keep below Prometheus's scrape_timeout)")
    parser.add_argument("--selftest-timeout", type=float, default=300.0,
                        help="seconds POST /control/selftest lets `robust-metrics selftest` run "
                             "before killing it")
    parser.add_argument("--selftest-arg", dest="selftest_args", action="append", default=[],
                        metavar="ARG", help="an option passed on to `robust-metrics selftest` "
                        "(e.g. --selftest-arg=--history=/var/lib/robust-metrics/flops.json); "
                        "repeatable")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    add_collector_flags(parser)


def _config(args: argparse.Namespace) -> SidecarConfig:
    host, port = parse_listen(args.listen)
    if not args.dir:
        raise ConfigError("--dir is required (or set ROBUST_METRICS_DIR)")
    config = SidecarConfig(
        directory=os.path.abspath(args.dir), host=host, port=port, node=args.node,
        collectors=enabled_names(args), web_config=args.web_config, token_file=args.token_file,
        sysfs=args.sysfs, nccl_ras_addr=args.nccl_ras_addr, nccl_interval=args.nccl_interval,
        merge_after=args.merge_after, retention=args.retention,
        stacks_timeout=args.stacks_timeout, nvml_retry=args.nvml_retry,
        collector_timeout=args.collector_timeout, gpu_peak_dtype=args.gpu_peak_dtype,
        gpu_peak_flops=list(args.gpu_peak_flops), selftest_timeout=args.selftest_timeout,
        selftest_args=list(args.selftest_args))
    config.validate()
    return config


def _prepare_dir(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--dir {directory}: cannot create it: {exc.strerror}") from None
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"--dir {directory}: needs read and write access")


def build(config: SidecarConfig):
    """The app and its parts, for `run` and for tests that serve it in-process."""
    from robust_metrics.sidecar.app import create_app
    from robust_metrics.sidecar.auth import TokenFile, load_web_config
    from robust_metrics.sidecar.rank_files import RankFiles

    _prepare_dir(config.directory)
    web = load_web_config(config.web_config) if config.web_config else None
    token = None
    if config.token_file:
        token = TokenFile(config.token_file)
        token.load()
    folder = RankFiles(config.directory, merge_after=config.merge_after,
                       retention=config.retention)
    infos = available()
    collectors: dict[str, Collector] = {
        name: infos[name].factory(config, folder) for name in config.collectors}

    registry = ScrapeRegistry(collectors, timeout=config.collector_timeout, node=config.node)

    def close() -> None:
        registry.close()
        for collector in collectors.values():
            closer = getattr(collector, "close", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    closer()
        folder.close()

    app = create_app(config, registry, folder, token=token, web=web, on_close=close,
                     selftest=collectors.get("selftest"))  # type: ignore[arg-type]
    return app, folder, web


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only for sockets
    # whose proto says TCP; with proto 0, keep-alive responses wait ~40 ms on delayed ACKs
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _config(args)
        app, folder, web = build(config)
    except ConfigError as exc:
        print(f"robust-metrics sidecar: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        sock = _bind(config.host, config.port)
    except OSError as exc:
        folder.close()
        reason = {errno.EADDRINUSE: "the port is already in use (another sidecar?)",
                  errno.EADDRNOTAVAIL: "the address is not on this machine",
                  errno.EACCES: "permission denied (ports below 1024 need privileges)"}.get(
                      exc.errno, exc.strerror)
        print(f"robust-metrics sidecar: cannot listen on {args.listen}: {reason}",
              file=sys.stderr)
        return EXIT_BIND
    import uvicorn

    tls = web.tls if web else None
    uv_config = uvicorn.Config(
        app, log_level="warning", lifespan="on", access_log=False, timeout_graceful_shutdown=5,
        ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
        ssl_cert_reqs=int(tls.client_auth) if tls else 0,
        ssl_ca_certs=tls.client_ca_file if tls else None)
    uv_config.load()
    if tls is not None and uv_config.ssl is not None:
        uv_config.ssl.minimum_version = tls.min_version
    bound_host, bound_port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    log.info("serving %s://%s:%d/metrics for %s (collectors: %s; archive owner: %s)", scheme,
             bound_host, bound_port, config.directory, ", ".join(config.collectors) or "none",
             folder.owner)
    uvicorn.Server(uv_config).run(sockets=[sock])
    return 0
