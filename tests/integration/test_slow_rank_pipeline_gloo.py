"""A rank slowed 1.3x in forward, backward or the optimizer is named by its compute time (the
compute/blocked split) on pipeline schedules (GPipe, 1F1B, interleaved) and a pipeline over
FSDP2: real gloo jobs of parallel_job.py with one `watch()` line, read back with
prometheus_client's MultiProcessCollector; no hook error, every collective entered also
completed, in the groups of the stack.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.parallel_jobs import CASES, run_slow_rank_case


@pytest.mark.parametrize("case", [case for case in CASES if case.startswith("pp-")])
def test_a_slow_rank_is_named_by_its_compute(tmp_path: Path, case: str) -> None:
    run_slow_rank_case(tmp_path, case)
