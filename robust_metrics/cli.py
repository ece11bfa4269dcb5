"""The `robust-metrics` command: one sub-command per deployable.

This module only registers the sub-commands. Each lives in its own module with two functions,
`configure(parser)` and `run(args) -> int`: a deployable's in the `cli.py` of its package
(`sidecar/cli.py`, `bridge/cli.py`, `dashboards/cli.py`, `analysis/whatif/cli.py`, `demo/cli.py`);
the small single-module tools keep theirs beside what they render (`rules.py`, `schema_cli.py`,
`analysis/stacks_cli.py`, `bridge/job_cli.py`). `robust-metrics --version` prints the package's
version. Modules are imported only when their sub-command runs, so
`robust-metrics sidecar` never pays for torch or matplotlib.

A command whose optional extra is not installed says which one (`pip install
'robust-metrics[sidecar]'`) and exits 2, instead of ending in a ModuleNotFoundError traceback:
the extras it needs are checked before its module is imported, and a third-party module found
missing later is reported the same way.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sidecar": ("robust_metrics.sidecar.cli", "node exporter: rank metrics, GPU, NIC, liveness, stacks"),
    "bridge": ("robust_metrics.bridge.cli", "Alertmanager webhook to checkpoint/stack/restart actions"),
    "job": ("robust_metrics.bridge.job_cli",
            "start, stop or show a job under the bridge's local scheduler (so it can restart it)"),
    "rules": ("robust_metrics.rules", "render the alert and recording rules (plain or PrometheusRule)"),
    "dashboards": ("robust_metrics.dashboards.cli", "write the Grafana dashboards as JSON"),
    "whatif": ("robust_metrics.analysis.whatif.cli", "what-if straggler analysis of an op trace"),
    "stacks": ("robust_metrics.analysis.stacks_cli", "localise a hang by aggregating rank stacks"),
    "schema": ("robust_metrics.schema_cli", "print the metric reference table"),
    "demo": ("robust_metrics.demo.cli", "run a training job, inject faults, watch them caught"),
    "selftest": ("robust_metrics.selftest.cli", "node self-test: compute, memory, links, GPU health"),
}


# name -> the extras it needs (see pyproject.toml's optional-dependencies)
EXTRAS: dict[str, tuple[str, ...]] = {
    "sidecar": ("sidecar",),
    "bridge": ("bridge",),
    "dashboards": ("dashboards",),
    "whatif": ("analysis",),
    "demo": ("torch", "sidecar", "bridge"),
}
# extra -> modules whose absence means the extra is not installed
_EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "sidecar": ("starlette", "uvicorn"),
    "bridge": ("starlette", "uvicorn", "httpx"),
    "dashboards": ("grafana_foundation_sdk",),
    "analysis": ("numpy", "pandas"),
    "torch": ("torch",),
    "kubernetes": ("kubernetes",),
    "otel": ("opentelemetry",),
}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_extras(command: str) -> list[str]:
    """The extras `command` needs whose modules are not importable here."""
    return [extra for extra in EXTRAS.get(command, ())
            if not all(_present(m) for m in _EXTRA_MODULES[extra])]


def _extra_for(command: str, module: str) -> list[str]:
    """The extra that provides `module` (by its top-level package), else the command's own."""
    top = module.partition(".")[0]
    known = [extra for extra, modules in _EXTRA_MODULES.items() if top in modules]
    own = [extra for extra in EXTRAS.get(command, ()) if extra in known]
    return own or known[:1] or list(EXTRAS.get(command, ()))


def _need_extras(command: str, extras: Sequence[str], module: str | None = None) -> int:
    names = " and ".join(", ".join(f"'{e}'" for e in extras).rsplit(", ", 1))
    plural = "extra" if len(extras) == 1 else "extras"
    print(f"robust-metrics {command} needs the {names} {plural}: "
          f"pip install 'robust-metrics[{','.join(extras)}]'", file=sys.stderr)
    if module:
        print(f"(the Python module {module!r} is not installed)", file=sys.stderr)
    return 2


def _version() -> str:
    from robust_metrics import __version__

    return f"robust-metrics {__version__}"


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="robust-metrics",
        description="Observability for large PyTorch training jobs: hangs, stragglers, NaNs, "
        "GPU and NIC faults, on Prometheus, Alertmanager and Grafana.",
        epilog="Run 'robust-metrics COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=_version())
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
        if args[0] == "--version":
            print(_version())
            return 0
        parser.parse_args(args[:1])  # exits with a clear "invalid choice" message
        return 2
    name = args[0]
    missing = missing_extras(name)
    if missing:
        return _need_extras(name, missing)
    module_name, text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(prog=f"robust-metrics {name}", description=text)
        module.configure(parser)
        return int(module.run(parser.parse_args(args[1:])) or 0)
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.partition(".")[0] == "robust_metrics":
            raise  # our own module missing is a bug, not an extra to install
        extras = _extra_for(name, exc.name)
        if not extras:
            raise
        return _need_extras(name, extras, exc.name)


if __name__ == "__main__":
    sys.exit(main())
