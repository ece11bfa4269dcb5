"""The order parallel workers take modules in: longest recorded first, unrecorded before all."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.module_order import longest_first


def _items(*nodeids: str) -> list[Any]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_modules_go_longest_first_and_keep_their_tests_order() -> None:
    items = _items("a.py::t2", "b.py::t1", "a.py::t1", "c.py::t1", "new.py::t1", "b.py::t2")
    seconds = {"a.py": 10.0, "b.py": 80.0, "c.py": 30.0}
    order = [i.nodeid for i in longest_first(items, seconds)]
    assert order == ["new.py::t1", "b.py::t1", "b.py::t2", "c.py::t1", "a.py::t2", "a.py::t1"]
