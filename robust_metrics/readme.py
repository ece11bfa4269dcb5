"""The generated parts of README.md: the metric and alert references.

`python -m robust_metrics.readme` rewrites them in place; a test fails when they are stale, so the
README always says what the schema and the shipped rules say.
"""

from __future__ import annotations

import sys
from pathlib import Path

from robust_metrics import rules, schema

README = Path(__file__).resolve().parent.parent / "README.md"


def alert_table() -> str:
    """One row per shipped alert: severity, the bridge action it asks for, and its summary."""
    rows = ["| alert | severity | action | summary |", "|---|---|---|---|"]
    for alert in rules.alerts(rules.load_groups()):
        labels = alert.get("labels", {})
        summary = " ".join(str(alert.get("annotations", {}).get("summary", "")).split())
        rows.append(f"| [`{alert['alert']}`](alert_rules/RUNBOOK.md#{alert['alert'].lower()}) | "
                    f"{labels.get('severity', '')} | `{labels.get('action', '')}` | {summary} |")
    return "\n".join(rows) + "\n"


SECTIONS = {"metrics": schema.markdown_table, "alerts": alert_table}


def render(text: str) -> str:
    """`text` with every generated section replaced by its current content."""
    for name, make in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
        head, sep, rest = text.partition(begin)
        if not sep:
            raise ValueError(f"README lacks the marker {begin.strip()}")
        _, sep, tail = rest.partition(end)
        if not sep:
            raise ValueError(f"README lacks the marker {end}")
        text = head + begin + make() + end + tail
    return text


def main() -> int:
    README.write_text(render(README.read_text()))
    print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
