"""Each package's modules import one another in layers, never in a circle.

The collector registry once imported the collectors package (lazily, inside a function) while each
collector imported the registry: eight modules in one circle, which a reader must hold whole to
change any of them. Every `import` statement counts here, those inside functions and
`TYPE_CHECKING` blocks too; a module's import of its own package's `__init__` (which Python runs
first anyway) is the only edge left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


def module_names(root: Path, package: str) -> dict[str, Path]:
    """`dotted.name -> file` of every module of `package` (a folder under `root`)."""
    out = {}
    for path in (root / package.replace(".", "/")).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom,
              known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Which of the package's modules each of its modules imports, wherever the import stands."""
    known = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(module, path, node, known):
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_the_sidecar_imports_in_a_circle() -> None:
    assert cycles(import_graph(ROOT, "robust_metrics.sidecar")) == []


PACKAGES = sorted(p.parent.name for p in (ROOT / "robust_metrics").glob("*/__init__.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_in_a_circle(package: str) -> None:
    """The same for every package of robust_metrics (the hooks' collective paths once formed
    one: collectives imported funcol lazily, funcol took collectives' private helpers)."""
    assert cycles(import_graph(ROOT, f"robust_metrics.{package}")) == []


def test_the_check_finds_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "registry.py").write_text("def available():\n    import pkg.sub\n")
    (package / "sub" / "__init__.py").write_text("from . import one\n")
    (package / "sub" / "one.py").write_text("from ..registry import available\n")
    (package / "leaf.py").write_text("from pkg import registry\n")

    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.registry", "pkg.sub", "pkg.sub.one"]]


def test_importing_the_registry_alone_registers_every_collector() -> None:
    """`available()` imports nothing: the package it lives in has imported every collector."""
    code = ("from robust_metrics.sidecar.collectors.registry import available\n"
            "print(' '.join(sorted(available())))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["nccl", "nic", "node_summaries", "nvml", "process", "ranks",
                                     "selftest"]
