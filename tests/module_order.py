"""The longest test modules first on parallel workers (pytest plugin).

`--dist loadfile` hands a worker its next module when it runs low, in queue order. xdist queues
the modules with the most tests first, so a module of one 80 s test often starts last and the
pass waits for it alone. Ordered by the seconds each module took (tests/module_seconds.json),
longest first, the last modules to start are the short ones. A module not in the file counts as
the longest. The order applies on xdist workers only, with `--no-loadscope-reorder` (xdist's own
order would replace it); a serial run keeps pytest-randomly's shuffled module order.

`pytest --record-module-seconds` writes the seconds of the modules that ran into the file.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("module_seconds.json")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """Items grouped by module, longest module first; the order within a module is kept."""
    cost = {module_of(item.nodeid): seconds.get(module_of(item.nodeid), math.inf)
            for item in items}
    return sorted(items, key=lambda item: -cost[module_of(item.nodeid)])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-module-seconds", action="store_true",
                     help=f"write each module's seconds (setup, call, teardown) into "
                          f"{SECONDS_FILE.name}, for the order of parallel runs")


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput") and not config.getoption("loadscopereorder", True):
        items[:] = longest_first(items, load_seconds())


class _Recorder:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        seconds = load_seconds() | {m: round(s, 1) for m, s in self.seconds.items()}
        SECONDS_FILE.write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("record_module_seconds") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(), "module-seconds-recorder")
