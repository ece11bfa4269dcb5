"""`robust-metrics dashboards`: write the dashboards' JSON, or check the committed files (CI).

    robust-metrics dashboards --out dashboards/           # write dashboards/*.json
    robust-metrics dashboards --out dashboards/ --check   # exit 1 when the committed JSON is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from robust_metrics.dashboards.render import render_all


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("dashboards"),
                        help="folder to write the dashboard JSON into (default: dashboards)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a file in --out differs from what the "
                             "generator writes, or is missing (for CI)")


def run(args: argparse.Namespace) -> int:
    try:
        files = render_all()
    except ImportError as exc:
        print(f"robust-metrics dashboards: {exc}; install the extra: "
              f"pip install 'robust-metrics[dashboards]'", file=sys.stderr)
        return 2
    out: Path = args.out
    if args.check:
        stale = [name for name, text in files.items()
                 if not (out / name).is_file() or (out / name).read_text() != text]
        if stale:
            print(f"stale dashboards in {out}: {', '.join(stale)}; regenerate with "
                  f"'robust-metrics dashboards --out {out}' and commit", file=sys.stderr)
            return 1
        print(f"{len(files)} dashboards in {out} are up to date")
        return 0
    if out.exists() and not out.is_dir():
        print(f"robust-metrics dashboards: --out {out} is not a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    print(f"wrote {len(files)} dashboards to {out}: {', '.join(files)}")
    return 0
