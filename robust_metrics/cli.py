"""The `robust-metrics` command: one sub-command per deployable.

Each sub-command lives in its own module with two functions, `configure(parser)` and
`run(args) -> int`. Modules are imported only when their sub-command runs, so `robust-metrics sidecar`
never pays for torch or matplotlib.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sidecar": ("robust_metrics.sidecar.main", "node exporter: rank metrics, GPU, NIC, liveness, stacks"),
    "bridge": ("robust_metrics.bridge.main", "Alertmanager webhook to checkpoint/stack/restart actions"),
    "rules": ("robust_metrics.rules", "render the alert and recording rules (plain or PrometheusRule)"),
    "dashboards": ("robust_metrics.dashboards.cli", "write the Grafana dashboards as JSON"),
    "whatif": ("robust_metrics.analysis.whatif.cli", "what-if straggler analysis of an op trace"),
    "stacks": ("robust_metrics.analysis.stacks_cli", "localise a hang by aggregating rank stacks"),
    "schema": ("robust_metrics.schema_cli", "print the metric reference table"),
    "demo": ("robust_metrics.demo.main", "run a training job, inject faults, watch them caught"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="robust-metrics",
        description="Observability for large PyTorch training jobs: hangs, stragglers, NaNs, "
        "GPU and NIC faults, on Prometheus, Alertmanager and Grafana.",
        epilog="Run 'robust-metrics COMMAND --help' for a command's options.",
    )
    parser.add_argument(
        "command", choices=sorted(COMMANDS), metavar="COMMAND",
        help="; ".join(f"{name}: {text}" for name, (_, text) in COMMANDS.items()),
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        parser = _top_parser()
        if not args or args[0] in ("-h", "--help"):
            parser.print_help()
            return 0 if args else 2
        parser.parse_args(args[:1])  # exits with a clear "invalid choice" message
        return 2
    name = args[0]
    module_name, text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"robust-metrics {name}", description=text)
    module.configure(parser)
    return int(module.run(parser.parse_args(args[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
