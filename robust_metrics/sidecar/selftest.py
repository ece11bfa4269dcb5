"""Running the node self-test for the sidecar: a subprocess, bounded in time, one at a time.

The sidecar never imports torch (it must stay light and alive when a check crashes or hangs), so
`POST /control/selftest` runs `robust-metrics selftest --json` as a child process in a session of
its own, with the sidecar's `--node` and `--selftest-arg` options, and kills the whole session
(the communication check's spawned ranks too) when it outlives `--selftest-timeout`. The request
body is checked here, field by field, so a bad request is a 400 that names the field.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from robust_metrics.selftest.api import CHECKS, Report

__all__ = ["SelftestError", "SelftestRequest", "SelftestTimeout", "command", "parse_request",
           "run_selftest"]

DIGEST = re.compile(r"[0-9a-f]{64}")
FIELDS = ("quick", "checks", "expect_digest", "fleet_median_flops")


class SelftestError(RuntimeError):
    """The self-test could not run or gave no readable report."""


class SelftestTimeout(SelftestError):
    """The self-test outlived its time and was killed."""


@dataclass(frozen=True)
class SelftestRequest:
    quick: bool = True
    checks: tuple[str, ...] = ()
    expect_digest: str | None = None
    fleet_median_flops: float | None = None


def parse_request(body: Any) -> SelftestRequest:
    """The request from a JSON body; ValueError names the bad field."""
    if body is None:
        return SelftestRequest()
    if not isinstance(body, Mapping):
        raise ValueError("the body must be a JSON object, e.g. {\"quick\": true}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; supported: {', '.join(FIELDS)}")
    quick = body.get("quick", True)
    if not isinstance(quick, bool):
        raise ValueError(f"quick={quick!r}: use true or false")
    checks = body.get("checks", [])
    if not isinstance(checks, list) or not all(c in CHECKS for c in checks):
        raise ValueError(f"checks={checks!r}: a list of {', '.join(CHECKS)}")
    digest = body.get("expect_digest")
    if digest is not None and not (isinstance(digest, str) and DIGEST.fullmatch(digest)):
        raise ValueError("expect_digest: a SHA-256 hex digest (64 lower-case hex digits)")
    fleet = body.get("fleet_median_flops")
    if fleet is not None and (isinstance(fleet, bool) or not isinstance(fleet, int | float)
                              or not 0 < fleet < float("inf")):
        raise ValueError(f"fleet_median_flops={fleet!r}: a positive number of FLOP/s")
    return SelftestRequest(quick, tuple(dict.fromkeys(checks)), digest,
                           None if fleet is None else float(fleet))


def command(node: str, request: SelftestRequest, extra: Sequence[str] = ()) -> list[str]:
    """The `robust-metrics selftest` command line for `request`."""
    argv = [sys.executable, "-m", "robust_metrics", "selftest", "--json", "--node", node,
            *extra]
    if request.quick:
        argv.append("--quick")
    for check in request.checks:
        argv += ["--check", check]
    if request.expect_digest:
        argv += ["--expect-digest", request.expect_digest]
    if request.fleet_median_flops:
        argv += ["--fleet-median-flops", repr(request.fleet_median_flops)]
    return argv


def run_selftest(argv: Sequence[str], timeout_s: float) -> Report:
    """Run the command; its report (exit 0 or 1), else SelftestError with its own words."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SelftestTimeout(f"the self-test ran longer than {timeout_s:g} s and was "
                              "killed") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # spawned ranks left behind by a crash
    if proc.returncode not in (0, 1):
        raise SelftestError(f"the self-test exited with {proc.returncode}: "
                            f"{err.strip()[-500:] or 'no message'}")
    try:
        return Report.from_dict(json.loads(out))
    except (ValueError, KeyError, TypeError) as exc:
        raise SelftestError(f"the self-test printed no readable report ({exc!r}): "
                            f"{out.strip()[-200:]}") from None
