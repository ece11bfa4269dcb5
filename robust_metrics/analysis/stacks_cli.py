"""`robust-metrics stacks`: which rank holds up a hung job, from the stacks of all its ranks.

    robust-metrics stacks --prometheus http://prometheus:9090 --run RUN --token-file TOKEN
    robust-metrics stacks http://node1:9741 http://node2:9741 --token-file TOKEN [--json]
    robust-metrics stacks --metrics-dir /run/robust-metrics        # ranks on this machine
    robust-metrics stacks --pid 4711 --pid 4712                     # any Python processes

It takes `--samples` rounds of dumps `--interval` seconds apart (so a healthy job, whose stacks
move, is told apart from a hung one), groups them with `robust_metrics.analysis.stacks.analyse`
and prints a report, or with `--json` the report object. Exit status: 0 no suspects, 1 suspects
named, 2 bad input, 3 no stack could be collected.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from robust_metrics.analysis import stacks_sources as sources
from robust_metrics.analysis.stacks import analyse
from robust_metrics.numbers import decimal
from robust_metrics.rankfolder.identity import rank_info as identity_rank_info

__all__ = ["EXIT_BAD_INPUT", "EXIT_NOTHING", "EXIT_SUSPECTS", "configure", "format_report", "run"]

EXIT_SUSPECTS = 1
EXIT_BAD_INPUT = 2
EXIT_NOTHING = 3
_FRAMES_SHOWN = 8


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones (None, False, [])."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def _positive(kind: type, maximum: float) -> Any:
    """An argparse type: a finite number in (0, maximum]; anything else is a usage error."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {maximum}")
        return value

    return parse


MAX_PID = 1 << 22
"""Linux's largest pid (pid_max cannot be set above 2**22)."""


def _share(text: str) -> float:
    value = _positive(float, math.inf)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in (0, 1]")
    return float(value)


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `robust-metrics stacks` (docs/stacks.md lists them all)."""
    parser.formatter_class = _HelpFormatter
    parser.add_argument("sidecars", nargs="*", metavar="SIDECAR_URL",
                        help="sidecar base URLs (http://node:9741); /debug/stacks is added")
    where = parser.add_argument_group("where the stacks come from (pick one)")
    where.add_argument("--prometheus", metavar="URL",
                       help="find the run's sidecars and topology through this Prometheus "
                            "(robust_rank_info and /api/v1/targets)")
    where.add_argument("--metrics-dir", metavar="DIR",
                       help="dump the ranks of this machine listed in DIR/ranks/*.json "
                            "(the ranks' ROBUST_METRICS_DIR) with py-spy")
    where.add_argument("--pid", type=_positive(int, MAX_PID), action="append", default=[],
                       help="dump this local process with py-spy (repeatable)")
    parser.add_argument("--run", help="the run to analyse (needed when several are found)")
    parser.add_argument("--token", help="bearer token of the sidecars' /debug/stacks")
    parser.add_argument("--token-file", help="file holding the bearer token (preferred: a token "
                        "on the command line is visible in ps)")
    parser.add_argument("--samples", type=_positive(int, 1000), default=3,
                        help="dump rounds; with 2 or more a job whose stacks move is not hung")
    parser.add_argument("--interval", type=_positive(float, 3600), default=0.5,
                        help="seconds between the starts of two dump rounds")
    parser.add_argument("--timeout", type=_positive(float, 3600), default=15.0,
                        help="seconds allowed for one round of one sidecar or of local dumps")
    parser.add_argument("--native", action="store_true",
                        help="include C/C++ frames (slower; for hangs inside extensions)")
    parser.add_argument("--no-locals", action="store_true",
                        help="do not dump local variables (they only tell a busy rank from a "
                             "stuck one and never appear in the report)")
    parser.add_argument("--min-share", type=_share, default=0.25,
                        help="a stack shared by this fraction of the ranks is healthy")
    parser.add_argument("--hang-fraction", type=_share, default=0.75,
                        help="the job is hung when this fraction of ranks kept the same stack")
    parser.add_argument("--all-threads", action="store_true",
                        help="let helper threads (not main, data loader or checkpoint) name "
                             "suspects too")
    parser.add_argument("--flight-recorder", metavar="PATH", action="append", default=[],
                        help="PyTorch Flight Recorder dump files or folders (repeatable); adds "
                             "the ranks missing from each process group's last collective")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Collect, analyse, print; the exit status says whether suspects were named."""
    try:
        collect, rank_info, run_id = _plan(args)
    except (sources.SourceError, ValueError, OSError) as exc:
        print(f"robust-metrics stacks: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    dumps: list[dict[str, Any]] = []
    for i in range(args.samples):
        started = time.monotonic()
        dumps.extend(collect())
        if i + 1 < args.samples:
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    if rank_info is None and args.sidecars:
        rank_info = identity_rank_info(d for d in dumps if isinstance(d, dict))
    if run_id is None:
        runs = sorted({str(d["run"]) for d in dumps if d.get("run")})
        if len(runs) > 1:
            print(f"robust-metrics stacks: ranks of several runs ({', '.join(runs)}); pick one "
                  "with --run", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        report = analyse(dumps, rank_info, min_share=args.min_share,
                         hang_fraction=args.hang_fraction, all_threads=args.all_threads)
    except ValueError as exc:
        print(f"robust-metrics stacks: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.flight_recorder:
        from robust_metrics.analysis.flight_recorder import analyse_paths

        try:
            report["flight_recorder"] = analyse_paths(args.flight_recorder)
        except (OSError, ValueError) as exc:
            print(f"robust-metrics stacks: flight recorder: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_report(report))
    if report["ranks_analysed"] == 0:
        return EXIT_NOTHING
    return EXIT_SUSPECTS if report["suspects"] else 0


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read(65536).strip()
        except UnicodeDecodeError:
            raise ValueError(f"--token-file {args.token_file}: not a text file") from None
        if not token:
            raise ValueError(f"--token-file {args.token_file}: the file is empty")
        return token
    return args.token or None


def _plan(args: argparse.Namespace) -> tuple[Any, dict | None, str | None]:
    """What one dump round does, the topology if known, and the run."""
    chosen = [name for name, on in (("SIDECAR_URL", bool(args.sidecars)),
                                    ("--prometheus", bool(args.prometheus)),
                                    ("--metrics-dir", bool(args.metrics_dir)),
                                    ("--pid", bool(args.pid))) if on]
    if len(chosen) != 1:
        raise ValueError("give exactly one source: SIDECAR_URL..., --prometheus, --metrics-dir "
                         f"or --pid (got {', '.join(chosen) or 'none'})")
    locals_ = not args.no_locals
    if args.sidecars or args.prometheus:
        token = _token(args)
        rank_info = None
        run_id = args.run
        if args.prometheus:
            run_id, urls, rank_info = sources.discover(args.prometheus, args.run, args.timeout)
        else:
            urls = [sources.stacks_url(u) for u in args.sidecars]

        def collect() -> list[dict[str, Any]]:
            return sources.fetch_all(urls, token=token, run=run_id, locals_=locals_,
                                     native=args.native, timeout=args.timeout)

        return collect, rank_info, run_id
    if args.metrics_dir:
        identities = sources.identities_from_dir(args.metrics_dir, args.run)
        pids = sorted(pid for pid in identities if _exists(pid))
        if not identities:
            raise ValueError(f"no rank of run {args.run!r} in {args.metrics_dir}/ranks"
                             if args.run else f"no rank identity in {args.metrics_dir}/ranks")
        rank_info = {rank: i for i in identities.values()
                     if (rank := decimal(str(i.get("rank")))) is not None}
        if len({i.get("run") for i in identities.values()}) > 1 and not args.run:
            runs = sorted({str(i.get("run")) for i in identities.values()})
            raise ValueError(f"ranks of several runs ({', '.join(runs)}); pick one with --run")

        def collect() -> list[dict[str, Any]]:
            return sources.local_dumps(pids, identities, locals_=locals_, native=args.native,
                                       timeout=args.timeout)

        return collect, _latest_per_rank(rank_info, identities), args.run
    pids = list(dict.fromkeys(args.pid))

    def collect() -> list[dict[str, Any]]:
        return sources.local_dumps(pids, None, locals_=locals_, native=args.native,
                                   timeout=args.timeout)

    return collect, None, args.run


def _exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") or _signal_zero(pid)


def _signal_zero(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _latest_per_rank(rank_info: dict[int, dict], identities: dict[int, dict]) -> dict[int, dict]:
    """A restarted rank leaves its old identity file behind: keep the newest per rank."""
    best: dict[int, dict] = {}
    for ident in identities.values():
        rank = decimal(str(ident.get("rank")))
        if rank is None:  # a label the job chose: it names, it is no rank number
            continue
        if rank not in best or float(ident.get("started") or 0) > float(
                best[rank].get("started") or 0):
            best[rank] = ident
    return best or rank_info


# -- the readable report --------------------------------------------------------------------
def _ranges(values: list[Any]) -> str:
    """`0-3, 5, 7-9` for rank lists of large jobs."""
    ints = sorted(v for v in values if isinstance(v, int))
    parts: list[str] = []
    i = 0
    while i < len(ints):
        j = i
        while j + 1 < len(ints) and ints[j + 1] == ints[j] + 1:
            j += 1
        parts.append(str(ints[i]) if i == j else f"{ints[i]}-{ints[j]}")
        i = j + 1
    parts.extend(str(v) for v in values if not isinstance(v, int))
    return ", ".join(parts) or "-"


def _coords(s: dict[str, Any]) -> str:
    bits = [f"pid {s['pid']}"]
    if s.get("local_rank") is not None:
        bits.append(f"local_rank {s['local_rank']}")
    for key in ("dp_rank", "pp_rank", "tp_rank"):
        if s.get(key) is not None:
            bits.append(f"{key.split('_')[0]} {s[key]}")
    return ", ".join(bits)


def format_report(report: dict[str, Any]) -> str:
    """The report as text an on-call engineer reads top-down: verdict, suspects, groups, errors."""
    lines: list[str] = []
    if report["ranks_analysed"] == 0:
        lines.append(f"run {report.get('run') or '?'}: no rank could be dumped")
        lines.extend(f"  {e.get('source') or e.get('pid')}: {e['error']}" for e in report["errors"])
        lines.extend(f"note: {note}" for note in report["notes"])
        return "\n".join(lines) + "\n"
    hung = report["hung"]
    verdict = {True: "hung", False: "progressing", None: "one sample, hang assumed"}[hung]
    lines.append(f"run {report.get('run') or '?'}: {report['ranks_analysed']} rank(s) analysed, "
                 f"{report['samples']} sample(s); job {verdict} "
                 f"({len(report['stable_ranks'])} rank(s) with an unchanged main stack)")
    if report["suspects"]:
        lines.append("")
        lines.append(f"SUSPECTS ({len(report['suspects'])}):")
        for s in report["suspects"]:
            who = f"rank {s['rank']}" if s["rank"] is not None else str(s["ident"])
            lines.append(f"  {who} on node {s['node'] or '?'} ({_coords(s)})")
            for reason in s["reasons"]:
                lines.append(f"    {reason}")
            for f in (s.get("main_frames") or [])[:_FRAMES_SHOWN]:
                lines.append(f"      {f['function']}  {f['file']}:{f['line']}")
        lines.append(f"SUSPECT NODES: {', '.join(report['nodes']) or '?'}")
        for kind, groups in report.get("topology", {}).items():
            for g in groups:
                key = ", ".join(f"{k}={v}" for k, v in g["key"].items())
                lines.append(f"  {kind} group ({key}): ranks {_ranges(g['ranks'])}; suspects "
                             f"{_ranges(g['suspects'])}")
    else:
        lines.append("")
        lines.append("no suspects")
    lines.append("")
    lines.append("GROUPS (role, ranks, verdict, state; innermost frame first):")
    for g in report["groups"]:
        stage = f" pp {g['pp_rank']}" if "pp_rank" in g else ""
        lines.append(f"  {g['role']}{stage}: {g['count']} rank(s) "
                     f"{'healthy' if g['healthy'] else 'OUTLIER'} {g['state']}: "
                     f"{_ranges(g['ranks'])}")
        for frame in g["signature"][:_FRAMES_SHOWN]:
            lines.append(f"      {frame}")
        if len(g["signature"]) > _FRAMES_SHOWN:
            lines.append(f"      ... {len(g['signature']) - _FRAMES_SHOWN} more frame(s)")
    if report["errors"]:
        lines.append("")
        lines.append("ERRORS:")
        for e in report["errors"]:
            who = f"rank {e['rank']}" if e.get("rank") is not None else (
                f"pid {e['pid']}" if e.get("pid") else e.get("source") or "?")
            lines.append(f"  {who}: {e['error']}")
    fr = report.get("flight_recorder")
    if fr:
        lines.append("")
        lines.append("FLIGHT RECORDER:")
        for g in fr.get("groups", []):
            lines.append(f"  process group {g['group']}: last collective {g['last_collective']} "
                         f"(seq {g['last_seq']}); missing ranks {_ranges(g['missing_ranks'])}")
        for e in fr.get("errors", []):
            lines.append(f"  {e}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
