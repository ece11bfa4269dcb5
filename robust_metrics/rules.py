"""`robust-metrics rules`: render the alert and recording rules, plain or as a PrometheusRule.

The YAML files in `alert_rules/` are the source; this module only reads, optionally rescales and
re-emits them, so what promtool tests is what ships. The package reaches them through the
`robust_metrics/alert_rules` link (a real directory inside the wheel).

Rescaling exists because the rules are written for production intervals (15 s scrape and
evaluation), while an end-to-end test wants the same judgement at 1 s intervals. `--time-scale F`
multiplies every time quantity by F: `for:`, range selectors `[5m]`, subqueries, `offset`, and
numeric time constants, which the sources mark with a trailing `# seconds` PromQL comment.
Thresholds that are ratios (compute ratio, slowdown, spike sigmas) do not change.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from robust_metrics import rule_shards

__all__ = [
    "NODE_SUMMARY_GROUP",
    "NODE_SUMMARY_SOURCES",
    "RULES_DIR",
    "RUNBOOK_BASE",
    "alerts",
    "format_duration",
    "load_groups",
    "parse_duration",
    "recording_rules",
    "render",
    "rule_files",
    "scale_duration",
    "scale_expr",
]

RULES_DIR = Path(__file__).resolve().parent / "alert_rules"
"""Where the rule sources live: `alert_rules/` of the checkout, packaged with robust_metrics."""

NODE_SUMMARY_GROUP = "robust-node-summaries"
"""The group that records the per-node window summaries from the ranks' own series, for
deployments without the sidecar, which publishes them itself (alert_rules/node_summaries.yml)."""
NODE_SUMMARY_SOURCES = ("rules", "sidecar")

RUNBOOK_BASE = "https://github.com/robust-metrics/robust-metrics/blob/main/alert_rules/RUNBOOK.md"
FORMATS = ("plain", "prometheus-operator")

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000,
             "w": 604_800_000, "y": 31_536_000_000}
_DURATION = r"(?:\d+(?:ms|[smhdwy]))+"
_DURATION_PART = re.compile(r"(\d+)(ms|[smhdwy])")
_RANGE = re.compile(rf"\[\s*({_DURATION})\s*(?::\s*({_DURATION})?\s*)?\]")
_OFFSET = re.compile(rf"\boffset\s+(-?)({_DURATION})\b")
_SECONDS_CONSTANT = re.compile(r"(\d+(?:\.\d+)?)(\s*#\s*seconds\b)")


def parse_duration(text: str) -> int:
    """Milliseconds of a Prometheus duration such as `1h30m` or `500ms`; ValueError otherwise."""
    text = text.strip()
    if not re.fullmatch(_DURATION, text):
        raise ValueError(f"{text!r} is not a Prometheus duration (e.g. 30s, 5m, 1h30m)")
    return sum(int(n) * _UNITS_MS[u] for n, u in _DURATION_PART.findall(text))


def format_duration(ms: int) -> str:
    """The shortest Prometheus duration for `ms` milliseconds (`0s` for zero)."""
    if ms <= 0:
        return "0s"
    parts = []
    for unit in ("d", "h", "m", "s", "ms"):
        size = _UNITS_MS[unit]
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(parts)


def scale_duration(text: str, factor: float) -> str:
    """`text` multiplied by `factor`, at least 1 ms unless it was zero."""
    ms = parse_duration(text)
    return format_duration(0 if ms == 0 else max(1, round(ms * factor)))


def scale_expr(expr: str, factor: float) -> str:
    """A PromQL expression with every range, subquery step, offset and `# seconds` constant scaled."""
    if factor == 1:
        return expr

    def _range(m: re.Match[str]) -> str:
        inner = scale_duration(m.group(1), factor)
        if m.group(0).find(":") >= 0:
            step = scale_duration(m.group(2), factor) if m.group(2) else ""
            return f"[{inner}:{step}]"
        return f"[{inner}]"

    def _offset(m: re.Match[str]) -> str:
        return f"offset {m.group(1)}{scale_duration(m.group(2), factor)}"

    def _constant(m: re.Match[str]) -> str:
        return f"{float(m.group(1)) * factor:g}{m.group(2)}"

    expr = _RANGE.sub(_range, expr)
    expr = _OFFSET.sub(_offset, expr)
    return _SECONDS_CONSTANT.sub(_constant, expr)


def rule_files(directory: Path = RULES_DIR) -> list[Path]:
    """The rule source files, in a stable order (unit tests and other YAML are left out)."""
    files = sorted(p for p in directory.glob("*.yml") if p.name != "alertmanager.yml")
    if not files:
        raise FileNotFoundError(f"no rule files (*.yml) in {directory}")
    return files


def _scale_rule(rule: dict[str, Any], factor: float, runbook_base: str) -> dict[str, Any]:
    out = dict(rule)
    out["expr"] = scale_expr(str(rule["expr"]), factor)
    for key in ("for", "keep_firing_for"):
        if key in out:
            out[key] = scale_duration(str(out[key]), factor)
    if "annotations" in out:
        annotations = {}
        for key, value in out["annotations"].items():
            value = str(value)
            if key == "runbook_url" and value.startswith(RUNBOOK_BASE):
                value = runbook_base + value[len(RUNBOOK_BASE):]
            annotations[key] = scale_expr(value, factor) if key == "description" else value
        out["annotations"] = annotations
    return out


def load_groups(directory: Path = RULES_DIR, *, time_scale: float = 1.0,
                runbook_base: str = RUNBOOK_BASE,
                node_summaries: str = "rules") -> list[dict[str, Any]]:
    """Every rule group of every source file, rescaled by `time_scale` (1: as written).

    `node_summaries="sidecar"` leaves out the group that records the per-node summaries of the
    ranks' windows from every rank's series: where a sidecar on every node publishes them, that
    group is the only rule work that still grows with ranks (`"rules"`, the default, keeps it
    and is right for any deployment: it skips runs whose sidecars publish summaries)."""
    if not time_scale > 0:
        raise ValueError(f"time scale must be a positive number, got {time_scale}")
    if node_summaries not in NODE_SUMMARY_SOURCES:
        raise ValueError(f"node summaries from {node_summaries!r}: choose one of "
                         f"{', '.join(NODE_SUMMARY_SOURCES)}")
    groups: list[dict[str, Any]] = []
    seen: dict[str, Path] = {}
    for path in rule_files(directory):
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
            raise ValueError(f"{path}: expected a mapping with a 'groups' list")
        for group in data["groups"]:
            name = group.get("name")
            if name in seen:
                raise ValueError(f"{path}: rule group {name!r} also defined in {seen[name]}")
            seen[name] = path
            if name == NODE_SUMMARY_GROUP and node_summaries == "sidecar":
                continue
            out = {k: v for k, v in group.items() if k != "rules"}
            if "interval" in out:
                out["interval"] = scale_duration(str(out["interval"]), time_scale)
            out["rules"] = [_scale_rule(r, time_scale, runbook_base) for r in group["rules"]]
            groups.append(out)
    return groups


def alerts(groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alerting rules of `groups`."""
    return [r for g in groups for r in g["rules"] if "alert" in r]


def recording_rules(groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recording rules of `groups`."""
    return [r for g in groups for r in g["rules"] if "record" in r]


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (PromQL, descriptions) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

_HEADER = ("# Generated by `robust-metrics rules{args}` from alert_rules/*.yml. Do not edit:\n"
           "# change the sources and regenerate.\n")


def render(groups: list[dict[str, Any]], fmt: str = "plain", *, name: str = "robust-metrics",
           namespace: str | None = None, labels: dict[str, str] | None = None,
           header_args: str = "") -> str:
    """The rules as a Prometheus rule file (`plain`) or a PrometheusRule object."""
    if fmt == "plain":
        document: dict[str, Any] = {"groups": groups}
    elif fmt == "prometheus-operator":
        metadata: dict[str, Any] = {"name": name}
        if namespace:
            metadata["namespace"] = namespace
        metadata["labels"] = {"app.kubernetes.io/name": "robust-metrics",
                              "app.kubernetes.io/component": "alert-rules", **(labels or {})}
        document = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                    "metadata": metadata, "spec": {"groups": groups}}
    else:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    body = yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return _HEADER.format(args=header_args) + body


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_./-]+", key):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _shards(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= rule_shards.MAX_SHARDS:
        raise argparse.ArgumentTypeError(
            f"must be between 1 and {rule_shards.MAX_SHARDS}, got {value}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of `robust-metrics rules`."""
    parser.add_argument("--format", choices=FORMATS, default="plain",
                        help="plain: a Prometheus rule file (rule_files:); prometheus-operator: a "
                        "PrometheusRule object for Kubernetes (default: plain)")
    parser.add_argument("--out", default="-",
                        help="file to write, '-' for standard output (default: -)")
    parser.add_argument("--time-scale", type=_positive, default=1.0, metavar="F",
                        help="multiply every window, offset, `for` and time constant by F; e.g. "
                        "0.0667 turns rules written for 15 s intervals into rules for 1 s "
                        "intervals (tests, demos); start the ranks judged by them with "
                        "ROBUST_METRICS_TIME_SCALE=F, so that the hook's step windows match. "
                        "Default: 1")
    parser.add_argument("--runbook-url", default=RUNBOOK_BASE, metavar="URL",
                        help="base URL of the runbook, for a private copy of RUNBOOK.md "
                        f"(default: {RUNBOOK_BASE})")
    parser.add_argument("--name", default="robust-metrics",
                        help="metadata.name of the PrometheusRule (default: robust-metrics)")
    parser.add_argument("--namespace", default=None,
                        help="metadata.namespace of the PrometheusRule (default: none)")
    parser.add_argument("--label", type=_label, action="append", default=[], metavar="KEY=VALUE",
                        help="extra metadata label of the PrometheusRule, e.g. release=prometheus "
                        "for an operator's ruleSelector (repeatable)")
    parser.add_argument("--rank-shards", type=_shards, default=1, metavar="N",
                        help="split the rank-by-rank rules of each group over N groups of rank "
                        "subsets, which Prometheus and vmalert evaluate in parallel: for runs of "
                        "thousands of ranks, where one group's evaluation would take seconds. "
                        "Chained alerts fire up to one evaluation interval later. Default: 1 "
                        f"(no split); at most {rule_shards.MAX_SHARDS}")
    parser.add_argument("--node-summaries", choices=NODE_SUMMARY_SOURCES, default="rules",
                        help="who computes the per-node summaries of the ranks' step windows "
                        "that the run-level straggler rules read. rules (default): a rule group "
                        "records them from every rank's series, right for any deployment (runs "
                        "whose sidecars publish them are skipped), but its work grows with ranks; "
                        "sidecar: leave that group out, for a fleet where `robust-metrics "
                        "sidecar` runs on every node (its node_summaries collector publishes them), "
                        "so that the rule work per round grows with nodes (docs/sizing.md)")
    parser.add_argument("--rules-dir", type=Path, default=RULES_DIR, metavar="DIR",
                        help="read rule sources from DIR instead of the packaged ones")


def run(args: argparse.Namespace) -> int:
    """Render the rules; 0 on success, 2 with a message on bad input."""
    try:
        groups = rule_shards.shard_by_rank(
            load_groups(args.rules_dir, time_scale=args.time_scale,
                        runbook_base=args.runbook_url.rstrip("#"),
                        node_summaries=args.node_summaries),
            args.rank_shards)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"robust-metrics rules: {exc}", file=sys.stderr)
        return 2
    header = f" --format {args.format}" if args.format != "plain" else ""
    if args.time_scale != 1:
        header += f" --time-scale {args.time_scale:g}"
    if args.rank_shards != 1:
        header += f" --rank-shards {args.rank_shards}"
    if args.node_summaries != "rules":
        header += f" --node-summaries {args.node_summaries}"
    text = render(groups, args.format, name=args.name, namespace=args.namespace,
                  labels=dict(args.label), header_args=header)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        try:
            Path(args.out).write_text(text)
        except OSError as exc:
            print(f"robust-metrics rules: cannot write {args.out}: {exc}", file=sys.stderr)
            return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="robust-metrics rules")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
