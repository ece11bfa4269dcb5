"""pytest plugin: the session fails when a process the harness started is still alive at its end.

Every Prometheus, Alertmanager, sidecar, bridge, rank and Slurm daemon the tests start goes
through `robust_metrics.processes`, which records it. A test that forgets to stop one would leave
it running on the CI machine (and holding its port); here it fails the run, names the processes,
and kills them so the machine is clean for the next run.
"""

from __future__ import annotations

import pytest

from robust_metrics import processes


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    alive = processes.leftovers()
    if not alive:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = ("processes started by the tests are still alive at the end of the session "
            "(stop them in the test or its fixture):\n  " + "\n  ".join(alive))
    if reporter is not None:
        reporter.write_line(text, red=True)
    else:
        print(text)
    processes.kill_leftovers()
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
