"""`robust-metrics schema`: print the metric reference generated from `robust_metrics.schema`."""

from __future__ import annotations

import argparse
import json

from robust_metrics import schema


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the schema as JSON")


def run(args: argparse.Namespace) -> int:
    if args.json:
        rows = [
            {"name": m.name, "type": str(m.type), "labels": list(m.labels),
             "source": str(m.source), "unit": m.unit, "help": m.help}
            for m in schema.all_metrics()
        ]
        print(json.dumps(rows, indent=2))
    else:
        print(schema.markdown_table(), end="")
    return 0
