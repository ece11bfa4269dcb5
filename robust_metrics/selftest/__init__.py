"""Node self-test: stop-time checks that find the machine to blame before a restart.

    from robust_metrics.selftest import SelftestOptions, run
    report = run(SelftestOptions(checks=("compute", "memory")))
    report.verdict, report.failed, [r.figure for r in report.results]

One module per check (`compute`, `memory`, `communication`, `gpu`), each a `run(options, fault)`
returning a `CheckResult`; `runner` runs them in order into a `Report`; `cli` is
`robust-metrics selftest`. The sidecar runs the command as a subprocess (it never imports torch)
and publishes the report as `robust_selftest_*` series; the bridge's `selftest` step asks the
sidecars of a run and drains the nodes that fail. docs/selftest.md has the details.
"""

from robust_metrics.selftest.api import CHECKS, FAULT_ENV, CheckResult, Report, Verdict, faults
from robust_metrics.selftest.runner import SelftestOptions, default_options, run

__all__ = ["CHECKS", "FAULT_ENV", "CheckResult", "Report", "SelftestOptions", "Verdict",
           "default_options", "faults", "run"]
