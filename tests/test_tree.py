"""The committed tree itself: no file tracked by git holds an unresolved merge conflict.

A conflict block is a line starting `<<<<<<<`, later a line starting `>>>>>>>`, with `=======`
(and diff3's `|||||||`) between them. Markdown and reStructuredText underline headings with
`=======`, so that line counts only inside a block; the opening and closing markers count anywhere.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.support import ROOT

OPEN, BASE, MIDDLE, CLOSE = "<" * 7, "|" * 7, "=" * 7, ">" * 7  # not spelled out: this file is tracked


def _is_marker(line: str, marker: str) -> bool:
    return line == marker or line.startswith(marker + " ")


def conflict_markers(root: Path, paths: Iterable[str]) -> list[str]:
    """`path:line: text` of every conflict-marker line in `paths` (relative to `root`); binary
    files (a NUL byte) and files that are gone are skipped."""
    found = []
    for name in paths:
        try:
            data = (root / name).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            continue  # deleted in the work tree, or a submodule
        if b"\0" in data:
            continue
        inside = False
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if _is_marker(line, OPEN):
                inside = True
            elif _is_marker(line, CLOSE):
                inside = False
            elif not (inside and (line == MIDDLE or _is_marker(line, BASE))):
                continue
            found.append(f"{name}:{number}: {line[:80]}")
    return found


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True,
                         check=True, timeout=60).stdout
    return [name for name in out.decode().split("\0") if name]


def test_no_tracked_file_holds_a_conflict_marker() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git work tree: nothing says which files are tracked")
    found = conflict_markers(ROOT, tracked_files(ROOT))
    assert not found, "unresolved merge conflicts:\n" + "\n".join(found)


def test_the_check_finds_a_conflict_in_a_tracked_file_only(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    conflict = f"# Title\n{OPEN} HEAD\nours\n{MIDDLE}\ntheirs\n{CLOSE} issue-16\nend\n"
    (tmp_path / "merged.md").write_text(conflict)
    (tmp_path / "untracked.md").write_text(conflict)
    (tmp_path / "heading.rst").write_text(f"Title\n{MIDDLE}\n\ntext\n")  # an underline
    (tmp_path / "image.bin").write_bytes(f"\0{OPEN} HEAD\n".encode())
    (tmp_path / "stray.txt").write_text(f"one\n{CLOSE} issue-16\n")  # a half-resolved block
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=60)
    subprocess.run(["git", "-C", str(tmp_path), "add", "merged.md", "heading.rst", "image.bin",
                    "stray.txt"], check=True, timeout=60)

    found = conflict_markers(tmp_path, tracked_files(tmp_path))

    assert found == ["merged.md:2: " + OPEN + " HEAD", "merged.md:4: " + MIDDLE,
                     "merged.md:6: " + CLOSE + " issue-16", "stray.txt:2: " + CLOSE + " issue-16"]


def test_underlines_outside_a_block_are_not_markers(tmp_path: Path) -> None:
    text = f"Heading\n{MIDDLE}\n{OPEN} a\nx\n{BASE} base\ny\n{MIDDLE}\nz\n{CLOSE} b\n{MIDDLE}\n"
    (tmp_path / "f.md").write_text(text)
    found = conflict_markers(tmp_path, ["f.md", "gone.md"])
    assert [int(hit.split(":")[1]) for hit in found] == [3, 5, 7, 9]  # not the underlines 2, 10


def test_benchmarks_import_nothing_from_the_tests() -> None:
    """A benchmark runs where the tests are not (an installed package and bench/): what it
    shares with them lives in robust_metrics/ or in bench/."""
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"bench/{path.name}:{node.lineno}: {name}" for name in names
                      if name == "tests" or name.startswith("tests.")]
    assert not found, "\n".join(found)
