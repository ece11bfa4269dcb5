"""The generated reference pages: docs/metrics.md (every metric) and docs/alerts.md (every alert).

`python -m robust_metrics.references` rewrites both; a test fails when either is stale, so the
references always say what the schema and the shipped rules say. They are pages of their own, not
README sections, so that the README stays a front page and a reader who wants one metric's labels
finds the whole table in one place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from robust_metrics import rules, schema

DOCS = Path(__file__).resolve().parent.parent / "docs"

METRICS_HEAD = """\
# Metric reference

Generated from `robust_metrics/schema.py` by `python -m robust_metrics.references`; do not edit by
hand: `tests/test_readme.py` fails when this page differs from the schema. `source` says who
publishes the metric: `rank` (the hook in the training process, served by the node sidecar from
the rank folder or in-process), `sidecar` (the node exporter) or `bridge` (the action bridge).
Per-rank series carry `run` and `rank` only; topology lives on `robust_rank_info`.

"""

ALERTS_HEAD = """\
# Alert reference

Generated from `alert_rules/*.yml` by `python -m robust_metrics.references`; do not edit by hand:
`tests/test_readme.py` fails when this page differs from the rules. Every alert has a runbook
section in `alert_rules/RUNBOOK.md` and promtool unit tests where it fires and where it must stay
silent. The `action` label tells the action bridge what to do (docs/rules.md, docs/bridge.md).

"""


def alert_table() -> str:
    """One row per shipped alert: severity, the bridge action it asks for, and its summary."""
    rows = ["| alert | severity | action | summary |", "|---|---|---|---|"]
    for alert in rules.alerts(rules.load_groups()):
        labels = alert.get("labels", {})
        summary = " ".join(str(alert.get("annotations", {}).get("summary", "")).split())
        rows.append(f"| [`{alert['alert']}`](../alert_rules/RUNBOOK.md#{alert['alert'].lower()}) | "
                    f"{labels.get('severity', '')} | `{labels.get('action', '')}` | {summary} |")
    return "\n".join(rows) + "\n"


def metrics_page() -> str:
    return METRICS_HEAD + schema.markdown_table()


def alerts_page() -> str:
    return ALERTS_HEAD + alert_table()


# Each generated page, by its path under docs/, and what writes it.
PAGES: dict[str, Callable[[], str]] = {"metrics.md": metrics_page, "alerts.md": alerts_page}


def stale(docs: Path = DOCS) -> list[str]:
    """The pages under `docs` whose text is not what the schema and the rules generate now."""
    return [name for name, make in PAGES.items()
            if not (docs / name).exists() or (docs / name).read_text() != make()]


def main() -> int:
    for name, make in PAGES.items():
        (DOCS / name).write_text(make())
        print(f"updated {DOCS / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
