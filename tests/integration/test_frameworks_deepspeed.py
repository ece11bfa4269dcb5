"""DeepSpeed with the one-line hook, `watch(engine, optimizer)`, at ZeRO 1, 2 and 3: real 2-rank
gloo jobs on DeepSpeed's CPU accelerator (`DS_ACCELERATOR=cpu`; its first start on a machine
compiles a small shared-memory communication op with g++, cached in ~/.cache/torch_extensions),
with two parameter groups as LLM recipes use and a rank slowed 1.3x
(tests/integration/framework_jobs.py).

DeepSpeed's optimizer steps its torch optimizer once per parameter group (ZeRO 1 and 2) or ZeRO-3
sub-group, and holds only the rank's partition of the gradients: the hook counts `engine.step()`
and publishes the global norm DeepSpeed clipped by.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.framework_jobs import (
    assert_collectives,
    assert_loss_and_grad_norm,
    assert_slow_rank_named,
    assert_steps_counted_once,
    run_framework,
)
from tests.integration.parallel_jobs import run_job, series, value

BUILD_S = 540
pytestmark = [
    pytest.mark.timeout(BUILD_S + 300),  # the first test's set-up may build the op
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install -e '.[deepspeed]')"),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                       reason="no C++ compiler: DeepSpeed's CPU accelerator compiles its "
                              "communication op at start"),
]

BUILD = ("from deepspeed.accelerator import get_accelerator; "
         "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")


@pytest.fixture(scope="module", autouse=True)
def communication_op() -> None:
    """DeepSpeed's CPU accelerator compiles its shared-memory communication op with g++ the first
    time a process starts it (161 s on a loaded 2-core machine; cached in
    ~/.cache/torch_extensions after): built once here, so no rank job spends its time on it."""
    done = subprocess.run([sys.executable, "-c", BUILD], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=BUILD_S, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# ZeRO stage -> (gradient accumulation steps, slow rank, ops that carry the gradients)
CASES = {
    1: (1, 1, {"all_reduce"}),
    2: (2, 0, {"all_reduce"}),
    3: (1, 1, {"all_gather", "reduce_scatter"}),
}


@pytest.mark.parametrize("zero", sorted(CASES), ids=lambda z: f"zero{z}")
def test_deepspeed_engine(tmp_path: Path, zero: int) -> None:
    grad_accum, slow, ops = CASES[zero]
    run = run_framework(tmp_path, "deepspeed", "--zero", str(zero), grad_accum=grad_accum,
                        slow=slow, env={"DS_ACCELERATOR": "cpu"})
    assert_steps_counted_once(run)
    assert_loss_and_grad_norm(run)
    assert_collectives(run, ops)
    assert_slow_rank_named(run)


def test_the_example_trains_with_the_one_line(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "examples" / "train_deepspeed.py"
    samples = run_job(tmp_path, 2, "--zero", "3", steps=4, env={"DS_ACCELERATOR": "cpu"}, script=script)
    for rank in range(2):
        assert value(samples, rank, "robust_steps_total") == 4
        assert series(samples, rank, "robust_hook_errors_total") == []
        ops = {ls["op"] for ls, v in series(samples, rank,
                                           "robust_collective_duration_seconds_count") if v}
        assert {"all_gather", "reduce_scatter"} <= ops, ops
