"""The README and the pages it sends a reader to say what the code does: generated references
(docs/metrics.md, docs/alerts.md), a quickstart that runs, real flags."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from robust_metrics import cli, references
from tests.support import ROOT

README = (ROOT / "README.md").read_text()
DEMO = (ROOT / "docs" / "demo.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()


def test_generated_references_are_current() -> None:
    assert not references.stale(), (
        f"stale references {references.stale()}: run `python -m robust_metrics.references`")


def test_the_staleness_check_sees_an_edited_page(tmp_path: Path) -> None:
    for name, make in references.PAGES.items():
        (tmp_path / name).write_text(make())
    assert references.stale(tmp_path) == []
    (tmp_path / "alerts.md").write_text(references.alerts_page().replace("RankHang", "RankHung"))
    (tmp_path / "metrics.md").unlink()
    assert references.stale(tmp_path) == ["metrics.md", "alerts.md"]


def test_every_shipped_alert_is_in_the_reference() -> None:
    from robust_metrics import rules

    alerts = (ROOT / "docs" / "alerts.md").read_text()
    for alert in rules.alerts(rules.load_groups()):
        assert f"`{alert['alert']}`" in alerts, alert["alert"]


def test_the_readme_sends_the_reader_to_the_references() -> None:
    for name in references.PAGES:
        assert f"(docs/{name})" in README, f"README does not link docs/{name}"


def test_the_one_line_hook_snippet_runs() -> None:
    snippet = README.split("## The one-line hook", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    prelude = (
        "import torch\n"
        "DDP = lambda m: m\n"
        "model = torch.nn.Linear(4, 1)\n"
        "loader = [torch.randn(2, 4) for _ in range(5)]\n"
        "saved = []\n"
        "save_checkpoint = saved.append\n"
        "def evaluate(m):\n    m(torch.randn(2, 4))\n"
    )
    check = ("\nvalues = {s.name: s.value for s in handle.store.samples()}\n"
             "assert values['robust_steps_total'] == 5, values\n"
             "assert values['robust_grad_norm'] > 0\n"
             "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", prelude + snippet + check], capture_output=True,
                          text=True, timeout=120, env={"ROBUST_METRICS_BACKEND": "null",
                                                       "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _options(command: str) -> set[str]:
    """The flags of a command and of its own sub-commands (`job start --config`)."""
    module = importlib.import_module(cli.COMMANDS[command][0])
    parser = argparse.ArgumentParser()
    module.configure(parser)
    parsers, flags = [parser], set()
    while parsers:
        actions = parsers.pop()._actions
        flags |= {s for action in actions for s in action.option_strings}
        parsers += [sub for action in actions if isinstance(action, argparse._SubParsersAction)
                    for sub in action.choices.values()]
    return flags


def documented_flags() -> list[tuple[str, str]]:
    """(command, flag) for every flag the README, docs/demo.md and docs/configuration.md show
    with a `robust-metrics COMMAND`, the demo's options and the sidecar's reference."""
    found = []
    for line in (README + DEMO + CONFIGURATION).splitlines():
        for command in cli.COMMANDS:
            if f"robust-metrics {command}" in line:
                found += [(command, f) for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9.-]*", line)]
    demo_table = DEMO.split("Options (`make demo", 1)[1].split("Ctrl-C", 1)[0]
    found += [("demo", f) for f in re.findall(r"`(--[a-z-]+)", demo_table)]
    sidecar_ref = CONFIGURATION.split("- **Sidecar**", 1)[1].split("- **Bridge**", 1)[0]
    found += [("sidecar", f) for f in re.findall(r"`(--[a-z.]+[a-z])`", sidecar_ref)]
    return sorted(set(found))


@pytest.mark.parametrize("command, flag", documented_flags())
def test_every_documented_flag_exists(command: str, flag: str) -> None:
    assert flag in _options(command), f"the docs document `robust-metrics {command} {flag}`"


def test_the_flag_scan_sees_the_documented_commands() -> None:
    commands = {c for c, _ in documented_flags()}
    assert {"demo", "sidecar", "stacks", "whatif", "rules", "dashboards"} <= commands
