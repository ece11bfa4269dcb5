"""docs/architecture.md's module table names every package and module of robust_metrics/.

The table is where the next engineer looks for who owns what; a module added without a row (or a
mention in its package's row) is a room the map does not show. A module counts as named when the
row of its package (the row whose first column names the nearest package above it) mentions it
in backticks by its file name or by its path below that package; a package when a row names it
or its parent's row mentions it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import ROOT

PACKAGE = ROOT / "robust_metrics"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HEADING = "## Modules and what each owns"


def module_rows(text: str) -> list[tuple[list[str], str]]:
    """(names in the first column, the row's whole text) for each row of the module table."""
    table = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        rows.append((re.findall(r"`([^`]+)`", first), line))
    return rows


def tree(root: Path) -> list[str]:
    """Every package (`hooks/`) and module (`hooks/watch.py`) under `root`, relative to it;
    `__init__.py` and `__main__.py` belong to their package, folders without Python are data."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root)
        if path.name not in ("__init__.py", "__main__.py"):
            found.append(rel.as_posix())
    for path in sorted(root.rglob("__init__.py")):
        if path.parent != root:
            found.append(path.parent.relative_to(root).as_posix() + "/")
    return sorted(set(found))


def unnamed(entries: list[str], rows: list[tuple[list[str], str]]) -> list[str]:
    """The entries of `tree()` that the rows name nowhere."""
    named = {name: line for names, line in rows for name in names}
    missing = []
    for entry in entries:
        if entry in named:
            continue
        parts = entry.rstrip("/").split("/")
        suffix = "/" if entry.endswith("/") else ""
        for cut in range(len(parts) - 1, 0, -1):
            owner = "/".join(parts[:cut]) + "/"
            if owner in named:
                below = "/".join(parts[cut:]) + suffix
                mentions = set(re.findall(r"`([^`]+)`", named[owner]))
                if below in mentions or parts[-1] + suffix in mentions:
                    break
                missing.append(entry)
                break
        else:
            missing.append(entry)
    return missing


def test_every_package_and_module_is_in_the_module_table() -> None:
    missing = unnamed(tree(PACKAGE), module_rows(ARCHITECTURE.read_text()))
    assert not missing, ("docs/architecture.md's module table names nowhere: "
                         + ", ".join(missing))


def test_the_check_sees_a_module_its_package_row_does_not_mention(tmp_path: Path) -> None:
    for name in ("a/__init__.py", "a/one.py", "a/two.py", "a/sub/__init__.py", "a/sub/deep.py",
                 "top.py", "lone.py", "b/__init__.py", "b/three.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    text = (f"{HEADING}\n\n| package / module | owns |\n|---|---|\n"
            "| `a/` | `one.py` (one), `sub/`: `deep.py` |\n| `top.py` | top |\n\n## Next\n"
            "| `b/` | `three.py` |\n")
    assert unnamed(tree(tmp_path), module_rows(text)) == ["a/two.py", "b/", "b/three.py",
                                                          "lone.py"]
