"""scripts/gpu-check: its verdict logic here, the checks themselves where a GPU exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_check import (  # noqa: E402
    Verdict,
    compare_nvml,
    exit_code,
    judge_events,
    judge_straggler,
    judge_streams,
    parse_smi,
    table,
)

SMI = """0, 81234, 41, 312.50
1, 0, 38, [N/A]
"""


def test_nvidia_smi_csv_is_parsed_in_base_units() -> None:
    parsed = parse_smi(SMI + "garbage line\n")
    assert parsed[0] == {"memory_bytes": 81234 * 2**20, "celsius": 41.0, "watts": 312.5}
    assert parsed[1] == {"memory_bytes": 0.0, "celsius": 38.0}  # power not supported


def test_nvml_agreeing_with_smi_passes_and_a_wrong_value_fails() -> None:
    smi = parse_smi(SMI)
    close = {0: {"memory_bytes": 81234 * 2**20 + 2**20, "celsius": 42.0, "watts": 300.0},
             1: {"memory_bytes": 0.0, "celsius": 38.0}}
    assert compare_nvml(close, smi).verdict == "PASS"
    wrong = {0: {**close[0], "celsius": 60.0}, 1: close[1]}
    verdict = compare_nvml(wrong, smi)
    assert verdict.verdict == "FAIL" and "gpu 0 celsius" in verdict.detail
    assert compare_nvml({0: close[0]}, smi).detail == "gpu 1: missing from the collector"


def test_event_timing_must_include_the_slow_kernel() -> None:
    assert judge_events(0.0105, slow=0.010, base=0.0004, wall_step=0.0104).verdict == "PASS"
    # a host-clock-like figure that missed the kernel
    assert judge_events(0.0004, slow=0.010, base=0.0004, wall_step=0.0104).verdict == "FAIL"


def test_blocked_must_be_the_compute_streams_wait_for_the_side_stream() -> None:
    """15 ms: the side stream held 20 ms, 5 of them overlapped by compute on the step's stream."""
    assert judge_streams(0.0148, late=0.020, overlap=0.005).verdict == "PASS"
    # marks on the side stream alone: the all-gather after the hold takes no time
    assert judge_streams(0.0001, late=0.020, overlap=0.005).verdict == "FAIL"
    assert judge_streams(0.0200, late=0.020, overlap=0.005).verdict == "FAIL"  # overlap counted


def test_a_straggler_job_passes_only_when_the_slowed_rank_alone_stands_out() -> None:
    named = judge_straggler("fsdp2", [0.100, 0.131], 1, 0, [20, 20], 20)
    assert named.verdict == "PASS" and "1.31" in named.detail
    assert judge_straggler("pp", [0.100, 0.112], 1, 0, [20, 20], 20).verdict == "FAIL"
    assert judge_straggler("pp", [0.131, 0.100], 1, 0, [20, 20], 20).verdict == "FAIL"
    assert judge_straggler("pp", [0.100, 0.131], 1, 3, [20, 20], 20).verdict == "FAIL"  # errors
    assert judge_straggler("pp", [0.100, 0.131], 1, 0, [20, 17], 20).verdict == "FAIL"
    assert judge_straggler("pp", [0.0, 0.0], 1, 0, [20, 20], 20).verdict == "FAIL"


def test_the_selftest_row_passes_only_a_gpu_compute_check_and_healthy_nvml() -> None:
    def report(device: str = "cuda", gpu: str = "pass", verdict: str = "pass") -> dict:
        return {"verdict": verdict, "results": [
            {"check": "compute", "verdict": "pass", "detail": "3 repeats identical",
             "data": {"device": device}},
            {"check": "gpu", "verdict": gpu, "detail": "no XID, ECC or throttle"}]}

    assert gpu_check.judge_selftest(report()).verdict == "PASS"
    assert gpu_check.judge_selftest(report(device="cpu")).verdict == "FAIL"
    assert gpu_check.judge_selftest(report(gpu="skipped")).verdict == "FAIL"
    failed = gpu_check.judge_selftest(report(verdict="fail"))
    assert failed.verdict == "FAIL" and "compute pass" in failed.detail


def test_every_check_has_a_limit_and_all_fit_in_5_minutes() -> None:
    assert set(gpu_check.LIMITS) == set(gpu_check.CHECKS)
    assert sum(gpu_check.LIMITS.values()) < 300


def test_verdicts_make_a_table_and_an_exit_status() -> None:
    passed, failed = Verdict("a", "PASS", "x"), Verdict("b", "FAIL", "y")
    assert table([passed, failed]).splitlines()[2:] == ["| a | PASS | x |", "| b | FAIL | y |"]
    assert exit_code([passed]) == 0 and exit_code([passed, failed]) == 1
    assert exit_code([Verdict("c", "SKIP", "no GPU")]) == 2


def test_a_failing_check_is_a_verdict_not_a_crash() -> None:
    """Each check runs in a child process; an exception there comes back as FAIL with its
    message (here: NVML or nvidia-smi missing, or a GPU that answers and passes)."""
    verdict = gpu_check.run_one("nvml")
    assert verdict.check == "nvml"
    if gpu_check.no_gpu_reason():
        assert verdict.verdict == "FAIL" and verdict.detail


def test_without_a_gpu_the_script_says_so_and_exits_2() -> None:
    if not gpu_check.no_gpu_reason():
        pytest.skip("a GPU is present: the real checks run in test_every_check_passes_on_a_gpu")
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "no GPU" in done.stderr and "Traceback" not in done.stderr + done.stdout
    assert done.stdout.count("| SKIP |") == len(gpu_check.CHECKS)


@pytest.mark.gpu
@pytest.mark.parametrize("check", gpu_check.CHECKS)
def test_every_check_passes_on_a_gpu(check: str) -> None:
    missing = gpu_check.no_gpu_reason()
    if missing:
        pytest.skip(missing)
    verdict = gpu_check.run_one(check)
    if verdict.verdict == "SKIP":  # fsdp2 and pp with fewer than 2 GPUs
        pytest.skip(verdict.detail)
    assert verdict.verdict == "PASS", verdict.detail


def test_the_cost_row_passes_only_a_cheap_default_and_reports_both_modes() -> None:
    def mode(cpu: float, wall: float, step: float) -> dict[str, float]:
        return {"hook_cpu_us": cpu, "hook_wall_us": wall, "base_wall_us": step}

    cheap = gpu_check.judge_cost(mode(40.0, 30.0, 2000.0), mode(60.0, 45.0, 2600.0))
    assert cheap.verdict == "PASS"
    assert "40 µs CPU" in cheap.detail and "60 µs CPU" in cheap.detail and "2.60 ms" in cheap.detail
    assert gpu_check.judge_cost(mode(150.0, 30.0, 10000.0), mode(60.0, 45.0, 10000.0)).verdict \
        == "FAIL"  # over 100 µs
    assert gpu_check.judge_cost(mode(60.0, 30.0, 1000.0), mode(60.0, 45.0, 1000.0)).verdict \
        == "FAIL"  # over 5% of a 1 ms step
    assert "cost" not in gpu_check.CHECKS and "cost" in gpu_check.ON_REQUEST  # not in 5 minutes
