"""`robust-metrics whatif TRACE`: the what-if straggler analysis from the shell.

Prints a readable summary (or one JSON object with --json); with --out also writes result.json,
heatmap.png and timeline.json (Chrome/Perfetto). Bad input (missing columns, an inconsistent op
graph, metadata that contradicts the trace) exits with status 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from robust_metrics.analysis.whatif.steps import StepRanges

__all__ = ["configure", "parse_steps", "run"]

PROGRESS_MIN_DP = 64
"""Draw a progress bar by default when the trace has at least this many DP ranks."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the whatif arguments to `parser`."""
    parser.add_argument("trace", metavar="TRACE",
                        help="trace: .parquet, .jsonl, or a folder of them (the hook's trace_dir)")
    parser.add_argument("--meta", metavar="META.yaml",
                        help="job metadata (dp_size, pp_size, tp_size, dsp_size, vpp_size, "
                        "world_size); default: inferred from the trace")
    for size in ("dp", "pp", "tp", "dsp", "vpp"):
        parser.add_argument(f"--{size}-size", type=int, default=None, metavar="N",
                            help=f"override {size}_size of the metadata")
    parser.add_argument("--steps", metavar="SPEC", default=None,
                        help="analyse only these steps, e.g. '5-20,31' (leave out warm-up)")
    parser.add_argument("--out", metavar="DIR",
                        help="write result.json, heatmap.png and timeline.json here")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the summary")
    parser.add_argument("--threshold", type=float, default=None, metavar="S",
                        help="attribute only when S reaches this (default 1.03)")
    parser.add_argument("--min-coverage", type=float, default=None, metavar="F",
                        help="attribute only when the traced ops explain this share of the "
                        "step (default 0.8)")
    parser.add_argument("--top", type=int, default=5, metavar="N",
                        help="entries per list in the summary (default 5)")
    parser.add_argument("--timeline-steps", type=int, default=2, metavar="N",
                        help="steps in timeline.json (default 2)")
    parser.add_argument("--timeline-dp-ranks", type=int, default=64, metavar="N",
                        help="DP ranks in timeline.json (default 64)")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", action="store_true", default=None,
                          help="always draw a progress bar on stderr")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help="never draw a progress bar")


def parse_steps(spec: str) -> StepRanges:
    """'5-8,12' -> steps 5, 6, 7, 8 and 12, kept as ranges (a range of 10**11 steps costs two
    numbers, not a set of 10**11); ValueError with the bad part otherwise."""
    ranges: list[tuple[int, int]] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
            else:
                lo = hi = int(part)
            if hi < lo or lo < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"--steps: {part!r} is not a step or a range like 5-20") from None
        ranges.append((lo, hi))
    return StepRanges(ranges)


def _fail(message: str) -> int:
    print(f"robust-metrics whatif: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the analysis; 0 on success, 2 on bad input."""
    from robust_metrics.analysis.whatif import GraphError, MetaError, TraceError, load_model
    from robust_metrics.analysis.whatif.analysis import (
        ATTRIBUTION_THRESHOLD,
        MIN_COVERAGE,
        analyze,
    )
    from robust_metrics.analysis.whatif.progress import make_progress
    from robust_metrics.analysis.whatif.report import summary

    for name in ("top", "timeline_steps", "timeline_dp_ranks"):
        if getattr(args, name) < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1")
    threshold = ATTRIBUTION_THRESHOLD if args.threshold is None else args.threshold
    if not math.isfinite(threshold) or threshold <= 0:
        return _fail("--threshold must be a finite number > 0")
    min_coverage = MIN_COVERAGE if args.min_coverage is None else args.min_coverage
    if not 0 <= min_coverage <= 1:  # NaN fails both comparisons
        return _fail("--min-coverage must be a fraction in [0, 1]")
    overrides = {f"{k}_size": getattr(args, f"{k}_size") for k in ("dp", "pp", "tp", "dsp", "vpp")}
    try:
        steps = parse_steps(args.steps) if args.steps else None
    except ValueError as exc:
        return _fail(str(exc))
    began = time.perf_counter()
    try:
        model = load_model(args.trace, args.meta, overrides, steps)
    except (TraceError, MetaError, GraphError) as exc:
        return _fail(str(exc))
    show = args.progress if args.progress is not None else model.dp >= PROGRESS_MIN_DP
    result = analyze(model, threshold=threshold, min_coverage=min_coverage,
                     progress=make_progress(bool(show)))
    elapsed = time.perf_counter() - began
    document = {**result.to_json(), "analysis_seconds": elapsed}
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            _write_outputs(out, result, model, document, args)
        except OSError as exc:
            return _fail(f"cannot write to --out {out}: {exc}")
    if args.json:
        json.dump(document, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(summary(result, top=args.top))
        if args.out:
            print(f"  wrote {args.out}/result.json, timeline.json"
                  + (", heatmap.png" if result.attributed else ""))
    return 0


def _write_outputs(out: Path, result, model, document: dict, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    from robust_metrics.analysis.whatif.plots import write_heatmap
    from robust_metrics.analysis.whatif.timeline import chrome_trace

    (out / "result.json").write_text(json.dumps(document, indent=2))
    if result.attributed:
        write_heatmap(result, out / "heatmap.png")
    with (out / "timeline.json").open("w") as f:
        json.dump(chrome_trace(model, steps=args.timeline_steps,
                               dp_ranks=args.timeline_dp_ranks), f)
