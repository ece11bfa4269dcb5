"""What the docs name exists: every alert a doc, an example or a deployment file refers to is an
alert of alert_rules/*.yml, and every repository path they name is in the repository.

A policy copied from a doc that matches an alert name that does not exist never matches,
silently; a path that moved sends the reader nowhere."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from robust_metrics import rules
from tests.support import ROOT

ALERTS = {a["alert"] for a in rules.alerts(rules.load_groups())}


def _files_under(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and
                  "__pycache__" not in p.parts)


DOCUMENTS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md",
                    *(ROOT / "examples").glob("*.yaml"), *_files_under("deploy"),
                    *_files_under("exporters")])

# An alert name where a label matcher or a policy says `alertname`: `alertname: X`,
# `{alertname: X}`, `alertname="X"`, `alertname=~"X|Y"`.
ALERTNAME = re.compile(r"""alertname\s*(?:=~|=|:)\s*["']?([A-Za-z0-9_|]+)""")
# A backticked CamelCase word (`RankHang`, `GPUXidCritical`): an alert unless the project's code
# or shipped configuration uses it as another name (a class, an exception, a Kubernetes kind, a
# systemd directive).
CAMEL = re.compile(r"`([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)`")
NOT_ALERTS = {"SlurmUser": "slurm.conf's user of the Slurm daemons (docs/schedulers.md)"}


def _code_names() -> set[str]:
    """Capitalised words of the package's code and the shipped deployment files."""
    names: set[str] = set()
    for path in [*(ROOT / "robust_metrics").rglob("*.py"), *_files_under("deploy"),
                 *_files_under("exporters")]:
        names |= set(re.findall(r"\b[A-Z][A-Za-z0-9]+\b", path.read_text(errors="replace")))
    return names - ALERTS


def _camel(word: str) -> bool:
    return sum(c.isupper() for c in word) >= 2


def alert_mentions(text: str, code_names: set[str]) -> Iterator[tuple[str, str]]:
    """(name, how it was found) for every alert name `text` refers to."""
    for match in ALERTNAME.finditer(text):
        for name in match.group(1).split("|"):
            if name:
                yield name, f"`{match.group(0)}`"
    for match in CAMEL.finditer(text):
        word = match.group(1)
        if _camel(word) and word not in code_names and word not in NOT_ALERTS:
            yield word, "a backticked alert-like name"


def test_alert_mentions_are_found_in_policies_matchers_and_prose() -> None:
    text = ("match: {alertname: StepHang}\n  - source_matchers: [alertname=\"TrainingHang\"]\n"
            "target_matchers: [alertname=~\"ThroughputDrop|SlowRank\"]\n"
            "the `GpuXidError` alert; the `LocalScheduler` class; `ConfigError`; `Lower`; "
            "`SlurmUser`")
    found = [name for name, _ in alert_mentions(text, {"LocalScheduler", "ConfigError"})]
    assert found == ["StepHang", "TrainingHang", "ThroughputDrop", "SlowRank", "GpuXidError"]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", DOCUMENTS, ids=_rel)
def test_every_alert_a_document_names_exists(path: Path) -> None:
    code_names = _code_names()
    unknown = sorted({f"{name} ({how})" for name, how in
                      alert_mentions(path.read_text(errors="replace"), code_names)
                      if name not in ALERTS})
    assert not unknown, (f"{_rel(path)} names alerts that alert_rules/*.yml does not define: "
                         f"{', '.join(unknown)}")


def test_the_scan_sees_the_alerts_of_the_docs() -> None:
    """The scan is not vacuous: it finds the alerts the alert reference (docs/alerts.md) and the
    schedulers' policy example name."""
    code_names = _code_names()
    reference = {n for n, _ in alert_mentions((ROOT / "docs" / "alerts.md").read_text(),
                                              code_names)}
    assert reference >= ALERTS
    schedulers = {n for n, _ in alert_mentions((ROOT / "docs" / "schedulers.md").read_text(),
                                               code_names)}
    assert schedulers & ALERTS


TOP = "robust_metrics|docs|bench|alert_rules|tests|examples|exporters|deploy|dashboards|scripts"
# A path from the repository root, as prose and code name it: `docs/bridge.md`,
# `tests/test_x.py::test_y` (the path part), `dashboards/*.json` (a pattern that must match).
REPO_PATH = re.compile(rf"(?<![\w/.~$@-])((?:{TOP})/[\w./*@<>{{}}-]*)")
# A Markdown link, relative to the document: [text](target#anchor)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _ignored(paths: list[str]) -> set[str]:
    """The paths git ignores: files a user writes (`robust-metrics rules --out ...`)."""
    if not paths:
        return set()
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    return set(done.stdout.split())


def named_paths(text: str) -> list[str]:
    """Repository paths `text` names (placeholders such as `<concern>` left out)."""
    found = []
    for match in REPO_PATH.finditer(text):
        path = match.group(1).rstrip(".,:;")
        if not any(c in path for c in "<>{}"):
            found.append(path)
    return found


def test_named_paths_finds_paths_and_skips_placeholders() -> None:
    text = ("see `docs/bridge.md`, (docs/rules.md). `tests/test_deploy.py::test_x` and "
            "`alert_rules/<concern>.yml`; `exporters/vmagent/vmagent@.service`, "
            "/etc/prometheus/targets/x.yml, $HOME/docs/x, `dashboards/*.json`")
    assert named_paths(text) == ["docs/bridge.md", "docs/rules.md", "tests/test_deploy.py",
                                 "exporters/vmagent/vmagent@.service", "dashboards/*.json"]


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


@pytest.mark.parametrize("path", DOCUMENTS, ids=_rel)
def test_every_path_a_document_names_exists(path: Path) -> None:
    text = path.read_text(errors="replace")
    missing = sorted({p for p in named_paths(text) if not _exists(p)})
    missing = sorted(set(missing) - _ignored(missing))
    links = sorted({t for t in LINK.findall(text) if "://" not in t and not t.startswith(
        "mailto:") and not (path.parent / t).exists()})
    assert not missing and not links, (
        f"{_rel(path)} names paths that do not exist: {', '.join(missing + links)}")


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def sidecar_commands(text: str) -> list[str]:
    """Every `robust-metrics sidecar ...` command line a shell block of `text` runs."""
    return [line for block in _shell_blocks(text) for line in block.splitlines()
            if re.match(r"\s*(sudo\b.*)?robust-metrics sidecar\s", line)]


def test_every_sidecar_quick_start_gives_it_a_token() -> None:
    """Stack dumps and checkpoint requests need the sidecar's bearer token: a sidecar started as
    a doc shows it must take `--token-file`, or the bridge gets 403 from both."""
    commands = {_rel(p): sidecar_commands(p.read_text()) for p in DOCUMENTS}
    started = {path: lines for path, lines in commands.items() if lines}
    assert {"README.md", "docs/sidecar.md", "docs/deploy-yourself.md"} <= set(started)
    bare = [f"{path}: {line.strip()}" for path, lines in started.items() for line in lines
            if "--token-file" not in line]
    assert not bare, "sidecar started without --token-file:\n" + "\n".join(bare)


def test_the_cpu_torch_the_docs_install_is_the_one_make_installs() -> None:
    """`pip install '.[torch]'` alone pulls the CUDA build: the README and the deployment page
    install the CPU build first, the version the Makefile pins."""
    pinned = re.search(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pinned, "Makefile: TORCH_VERSION"
    cpu = (f"pip install torch=={pinned.group(1)} --index-url "
           "https://download.pytorch.org/whl/cpu")
    for path in (ROOT / "README.md", ROOT / "docs" / "deploy-yourself.md"):
        lines = [ln.strip() for block in _shell_blocks(path.read_text())
                 for ln in block.splitlines()]
        assert cpu in lines, f"{_rel(path)} does not install the CPU build of torch"
        extra = next(i for i, ln in enumerate(lines) if re.match(r"pip install '\.\[.*torch", ln))
        assert lines.index(cpu) < extra, f"{_rel(path)}: the CPU build must come first"
