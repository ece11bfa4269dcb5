"""What every self-test check returns, and how a fault is injected at a check's own boundary.

A check is a function that returns a `CheckResult`: a verdict (`pass`, `fail`, `skipped`), one
figure in a base unit (FLOP/s, bytes, bytes per second, problems found) and the evidence behind the
verdict in `data`, so a caller (the sidecar, the bridge, a prolog) can act on the verdict and a
person can see why. `Report` is one run of several checks on one node.

Faults are injected where each check meets the thing it tests (the matmul result, the buffer, a
rank's link, the NVML answers), never by patching the verdict, so a test that injects one proves
the check itself catches it. They come from `ROBUST_SELFTEST_FAULT` (comma-separated, e.g.
`compute,communication:rank=1`) or `--inject-fault`, which the sidecar's subprocess inherits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["CHECKS", "FAULT_ENV", "CheckResult", "Report", "Verdict", "faults"]

Verdict = Literal["pass", "fail", "skipped"]
CHECKS: tuple[str, ...] = ("compute", "memory", "communication", "gpu")
FAULT_ENV = "ROBUST_SELFTEST_FAULT"


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict, its figure (in `unit`, a base unit) and its evidence."""

    check: str
    verdict: Verdict
    figure: float | None
    unit: str
    detail: str
    duration_seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


@dataclass(frozen=True)
class Report:
    """One self-test run on one node: the results of its checks, in the order they ran."""

    node: str
    started: float
    duration_seconds: float
    results: tuple[CheckResult, ...]

    @property
    def verdict(self) -> Verdict:
        """`fail` when any check failed; `skipped` when every check was skipped; else `pass`."""
        verdicts = {r.verdict for r in self.results}
        if "fail" in verdicts:
            return "fail"
        return "pass" if "pass" in verdicts else "skipped"

    @property
    def failed(self) -> list[str]:
        return [r.check for r in self.results if r.verdict == "fail"]

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "verdict": self.verdict, "failed": self.failed,
                "started": self.started, "duration_seconds": self.duration_seconds,
                "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        """Read a report back (the sidecar reads its subprocess's `--json` answer)."""
        results = tuple(CheckResult(**{k: r[k] for k in CheckResult.__dataclass_fields__ if k in r})
                        for r in data["results"])
        return cls(str(data["node"]), float(data["started"]), float(data["duration_seconds"]),
                   results)


MAX_FAULT_SECONDS = 60.0
"""The longest injected delay: a fault is for tests, and a longer one is surely a typo that would
hold a check (and the sidecar's self-test) for hours."""


def _seconds(value: str) -> str | None:
    """Why `value` is no delay in [0, MAX_FAULT_SECONDS] seconds, or None."""
    try:
        number = float(value)
    except ValueError:
        return "is not a number of seconds"
    if not 0 <= number <= MAX_FAULT_SECONDS:  # NaN fails both comparisons
        return f"must be a number of seconds in [0, {MAX_FAULT_SECONDS:g}]"
    return None


def _index(value: str) -> str | None:
    """Why `value` is no non-negative whole number (1 to 18 digits), or None."""
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        return "must be a whole number >= 0"
    return None


_FAULT_PARAMETERS: dict[str, dict[str, Any]] = {
    "compute": {"slow": _seconds},
    "memory": {"offset": _index},
    "communication": {"rank": _index, "delay": _seconds},
    "gpu": {},
}
"""Each check's fault parameters and the test of their values: a value a check cannot use would
otherwise be read as no fault (a rank named `x` is no rank) or end the check with a traceback."""


def faults(extra: str | None = None) -> dict[str, dict[str, str]]:
    """Injected faults by check: `compute` -> {}, `communication:rank=1` -> {"rank": "1"}.

    Read from `ROBUST_SELFTEST_FAULT` plus `extra` (the `--inject-fault` option). An unknown
    check or parameter, a parameter without a value and a value the check cannot use raise
    ValueError with a one-line message, so a typo in a test never passes silently as "no fault".
    """
    out: dict[str, dict[str, str]] = {}
    for item in ",".join(x for x in (os.environ.get(FAULT_ENV, ""), extra or "") if x).split(","):
        item = item.strip()
        if not item:
            continue
        check, _, params = item.partition(":")
        check = check.strip()
        if check not in CHECKS:
            raise ValueError(f"fault {item!r}: unknown check {check!r} (one of {', '.join(CHECKS)})")
        allowed = _FAULT_PARAMETERS[check]
        options = out.setdefault(check, {})
        for param in filter(None, (p.strip() for p in params.split(";"))):
            key, eq, value = (part.strip() for part in param.partition("="))
            if key not in allowed:
                known = ", ".join(allowed) or "none"
                raise ValueError(f"fault {item!r}: unknown parameter {key!r} of {check} "
                                 f"(known: {known})")
            problem = "needs a value (key=value)" if not eq or not value else allowed[key](value)
            if problem:
                raise ValueError(f"fault {item!r}: {key}={value!r} {problem}")
            options[key] = value
    return out
