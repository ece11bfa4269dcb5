"""The node self-test: each check passes on a healthy node and fails, naming the fault, when a
fault is injected at the check's own boundary (a flipped result bit, a flipped buffer byte, a slow
rank's link, NVML answers). Real gloo ranks for the communication check:
tests/integration/test_selftest.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from robust_metrics.cli import main
from robust_metrics.selftest import Report, SelftestOptions, communication, compute, faults, gpu, memory, run
from tests.sidecar_fakes import FakeGpu, FakeNvml

SMALL = compute.ComputeOptions(size=64, repeats=3)


# ---------------------------------------------------------------- compute
def test_compute_repeats_match_and_the_digest_depends_only_on_seed_and_size() -> None:
    first, again = compute.run(SMALL), compute.run(SMALL)
    other = compute.run(compute.ComputeOptions(size=64, repeats=3, seed=7))
    assert first.verdict == "pass", first.detail
    assert len(set(first.data["digests"])) == 1
    assert first.data["digest"] == again.data["digest"] != other.data["digest"]
    assert first.unit == "flops" and first.figure and first.figure > 0


def test_a_flipped_result_bit_fails_as_silent_data_corruption() -> None:
    result = compute.run(SMALL, {})
    assert result.verdict == "fail"
    assert "silent data corruption" in result.detail
    assert len(set(result.data["digests"])) == 2


def test_a_peer_digest_is_compared() -> None:
    digest = compute.run(SMALL).data["digest"]
    same = compute.run(compute.ComputeOptions(size=64, repeats=3, expect_digest=digest))
    other = compute.run(compute.ComputeOptions(size=64, repeats=3, expect_digest="0" * 64))
    assert same.verdict == "pass"
    assert other.verdict == "fail" and "differs from the peer" in other.detail


def test_throughput_is_judged_against_history_and_fleet(tmp_path: Path) -> None:
    history = tmp_path / "history.json"
    ok = compute.run(compute.ComputeOptions(size=64, repeats=3, history=str(history)))
    assert ok.verdict == "pass"
    assert json.loads(history.read_text())["compute_flops"] == [ok.figure]
    history.write_text(json.dumps({"compute_flops": [1e18, 1e18]}))
    slow = compute.run(compute.ComputeOptions(size=64, repeats=3, history=str(history)))
    assert slow.verdict == "fail" and "this node's median" in slow.detail
    assert json.loads(history.read_text())["compute_flops"] == [1e18, 1e18]  # not the baseline
    fleet = compute.run(compute.ComputeOptions(size=64, repeats=3, fleet_median_flops=1e18))
    assert fleet.verdict == "fail" and "the fleet median" in fleet.detail


def test_an_injected_slowdown_fails_against_the_history(tmp_path: Path) -> None:
    history = tmp_path / "history.json"
    healthy = compute.run(compute.ComputeOptions(size=128, repeats=3, history=str(history)))
    slowed = compute.run(compute.ComputeOptions(size=128, repeats=2, history=str(history)),
                         {"slow": "0.2"})
    assert healthy.verdict == "pass"
    assert slowed.verdict == "fail" and slowed.figure < 0.5 * healthy.figure


def test_an_unreadable_history_counts_as_none(tmp_path: Path) -> None:
    history = tmp_path / "history.json"
    history.write_text("{not json")
    assert compute.run(compute.ComputeOptions(size=64, repeats=2,
                                              history=str(history))).verdict == "pass"


# ---------------------------------------------------------------- memory
def test_memory_verifies_every_pattern() -> None:
    result = memory.run(memory.MemoryOptions(size_bytes=1 << 20))
    assert result.verdict == "pass" and result.figure == float(1 << 20)
    assert result.data["patterns"] == 3


def test_a_flipped_byte_fails_naming_pattern_and_offset() -> None:
    result = memory.run(memory.MemoryOptions(size_bytes=1 << 20), {"offset": "12345"})
    assert result.verdict == "fail"
    assert result.data == {"pattern": "0x55", "offset": 12345}
    assert "byte 12345 read back 0x54, wrote 0x55" in result.detail


# ---------------------------------------------------------------- communication
def _pairs(*bandwidths: float) -> dict:
    world = len(bandwidths)
    return {"bus_bandwidth": 1e9, "nodes": [f"n{i}" for i in range(world)],
            "pairs": [{"ranks": sorted([i, (i + 1) % world]), "bandwidth": b}
                      for i, b in enumerate(bandwidths)]}


def test_judge_names_the_rank_in_every_slow_pair() -> None:
    options = communication.CommunicationOptions()
    # pairs (0,1) fast, (1,2) slow, (0,2) slow -> rank 2
    result = _pairs(4e9, 1e9, 1e9)
    result["pairs"][2]["ranks"] = [0, 2]
    problems, culprits = communication.judge(result, options, None)
    assert culprits == [2]
    assert problems[0] == "rank 2 (n2) is in every slow pair"
    # one rank per node: the culprit's node answers for its slow pairs, its partners do not
    assert communication.judge(result, options, 1) == ([], [2])
    assert communication.judge(result, options, 0) == ([], [2])
    mine, _ = communication.judge(result, options, 2)
    assert len(mine) == 3 and "rank 1 (n1) - rank 2 (n2)" in mine[1]
    # one slow pair and no culprit: both of its ends are blamed
    alone = _pairs(4e9, 1e9, 4e9)
    alone["pairs"][2]["ranks"] = [0, 2]
    assert communication.judge(alone, options, 0)[0] == []
    assert len(communication.judge(alone, options, 1)[0]) == 1
    assert len(communication.judge(alone, options, 2)[0]) == 1
    assert communication.judge(_pairs(4e9, 3e9, 3.5e9), options, None) == ([], [])


def test_judge_applies_the_bus_bandwidth_floor() -> None:
    options = communication.CommunicationOptions(min_bus_bandwidth=2e9)
    problems, _ = communication.judge(_pairs(4e9, 4e9, 4e9), options, None)
    assert problems == ["bus bandwidth 1.000 GB/s is below the floor 2.000 GB/s"]


def test_a_group_of_one_is_skipped() -> None:
    result = communication.run(communication.CommunicationOptions(world_size=1))
    assert result.verdict == "skipped"


# ---------------------------------------------------------------- gpu
def _healthy(uuid: str) -> FakeGpu:
    return FakeGpu(uuid, throttle=0x4, ecc=(3, 0), remap=(0, 0, 0, 0))


def test_healthy_gpus_pass() -> None:
    result = gpu.run(gpu.GpuOptions(xid_wait_s=0.01), nvml=FakeNvml([_healthy("a"), _healthy("b")]))
    assert result.verdict == "pass", result.detail
    assert result.figure == 0.0 and result.data["gpus"] == 2


@pytest.mark.parametrize(("change", "message"), [
    ({"ecc": (0, 2)}, "GPU 1: 2 uncorrected ECC error(s)"),
    ({"remap": (0, 0, 1, 0)}, "GPU 1: a row remap is pending"),
    ({"remap": (0, 0, 0, 1)}, "GPU 1: a row remap failed"),
    ({"throttle": 0x40}, "GPU 1: clocks held down (hw_thermal_slowdown)"),
    ({"lost": True}, "GPU 1: lost"),
])
def test_each_gpu_fault_fails_naming_the_gpu(change: dict, message: str) -> None:
    bad = _healthy("b")
    for key, value in change.items():
        setattr(bad, key, value)
    result = gpu.run(gpu.GpuOptions(xid_wait_s=0.01), nvml=FakeNvml([_healthy("a"), bad]))
    assert result.verdict == "fail"
    assert result.figure == 1.0
    assert message in result.detail


def test_an_xid_event_fails() -> None:
    nvml = FakeNvml([_healthy("a")])
    nvml.events.put((0, 79))
    result = gpu.run(gpu.GpuOptions(xid_wait_s=0.2), nvml=nvml)
    assert result.verdict == "fail" and "GPU 0: XID 79" in result.detail


def test_the_injected_fault_goes_through_nvml() -> None:
    result = gpu.run(gpu.GpuOptions(xid_wait_s=0.01), {}, nvml=FakeNvml([_healthy("a")]))
    assert result.verdict == "fail" and "GPU 0: a row remap is pending" in result.detail


def test_no_driver_or_no_pynvml_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    no_driver = gpu.run(gpu.GpuOptions(), nvml=FakeNvml([], init_error=9))
    assert no_driver.verdict == "skipped" and "did not initialise" in no_driver.detail
    assert gpu.run(gpu.GpuOptions(), nvml=FakeNvml([])).verdict == "skipped"
    monkeypatch.setitem(sys.modules, "pynvml", None)
    missing = gpu.run(gpu.GpuOptions())
    assert missing.verdict == "skipped" and "nvidia-ml-py" in missing.detail


@pytest.mark.gpu
def test_real_gpus_get_a_verdict() -> None:
    result = gpu.run(gpu.GpuOptions(xid_wait_s=0.2))
    assert result.verdict in ("pass", "fail")
    assert result.data["gpus"] >= 1 and result.figure is not None


@pytest.mark.gpu
def test_real_gpu_compute_matches_bit_for_bit() -> None:
    result = compute.run(compute.ComputeOptions(size=2048, repeats=3, device="cuda"))
    assert result.verdict == "pass", result.detail


# ---------------------------------------------------------------- runner and command
def test_faults_parse_and_reject_unknown_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROBUST_SELFTEST_FAULT", "compute")
    assert faults("communication:rank=2;delay=0.1") == {
        "compute": {}, "communication": {"rank": "2", "delay": "0.1"}}
    with pytest.raises(ValueError, match="unknown check 'compte'"):
        faults("compte")


def test_the_report_fails_when_one_check_fails_and_round_trips() -> None:
    options = SelftestOptions(node="n1", checks=("compute", "memory"), compute=SMALL,
                              memory=memory.MemoryOptions(size_bytes=1 << 16),
                              inject_fault="memory")
    report = run(options)
    assert report.verdict == "fail" and report.failed == ["memory"]
    assert [r.verdict for r in report.results] == ["pass", "fail"]
    assert all(r.duration_seconds > 0 for r in report.results)
    again = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report


def test_a_check_that_raises_is_skipped_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(options: object, fault: object = None) -> None:
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(memory, "run", broken)
    report = run(SelftestOptions(checks=("memory",)))
    assert report.verdict == "skipped"
    assert "the check itself failed" in report.results[0].detail


def test_the_command_prints_json_and_exits_by_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["selftest", "--quick", "--check", "compute", "--check", "memory", "--size", "64",
            "--memory-bytes", "65536", "--node", "n7", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["node"] == "n7" and report["verdict"] == "pass"
    assert [r["check"] for r in report["results"]] == ["compute", "memory"]
    assert main([*args, "--inject-fault", "compute"]) == 1
    assert json.loads(capsys.readouterr().out)["failed"] == ["compute"]


@pytest.mark.parametrize(("args", "message"), [
    (["--inject-fault", "nope"], "unknown check 'nope'"),
    (["--size", "0"], "must be a positive integer"),
    (["--min-fraction", "2"], "must be a fraction"),
    (["--check", "disk"], "invalid choice"),
])
def test_the_command_rejects_bad_options(args: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["selftest", *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "message"), [
    ("compute:slow=abc", "slow='abc' is not a number of seconds"),
    ("memory:offset=zz", "offset='zz' must be a whole number >= 0"),
    ("communication:rank=x;delay=0.05", "rank='x' must be a whole number >= 0"),
    ("communication:rank=1;delay=soon", "delay='soon' is not a number of seconds"),
    ("compute:slow=nan", "must be a number of seconds in [0, 60]"),
    ("compute:slow=-1", "must be a number of seconds in [0, 60]"),
    ("compute:slow=inf", "must be a number of seconds in [0, 60]"),
    ("communication:rank=0;delay=1e400", "must be a number of seconds in [0, 60]"),
    ("compute:slow=3600", "must be a number of seconds in [0, 60]"),
    ("memory:offset=-1", "must be a whole number >= 0"),
    ("memory:offset=1.5", "must be a whole number >= 0"),
    ("memory:offset=" + "9" * 5000, "must be a whole number >= 0"),
    ("communication:rank=\u0661", "must be a whole number >= 0"),  # an Arabic-Indic digit
    ("compute:slow", "needs a value"),
    ("compute:slow=", "needs a value"),
    ("compute:fast=1", "unknown parameter 'fast' of compute (known: slow)"),
    ("gpu:xid=79", "unknown parameter 'xid' of gpu (known: none)"),
    ("memory:offset=1\nrm -rf", "must be a whole number >= 0"),
    ("communication:rank=7", "no such rank in a group of 2"),
    ("nope", "unknown check 'nope'"),
])
@pytest.mark.parametrize("where", ["option", "environment"])
def test_malformed_faults_exit_2_with_one_line(spec: str, message: str, where: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    args = ["selftest", "--quick", "--check", "communication", "--check", "memory",
            "--world-size", "2"]
    if where == "option":
        args += ["--inject-fault", spec]
    else:
        monkeypatch.setenv("ROBUST_SELFTEST_FAULT", spec)
    assert main(args) == 2  # before any check runs: nothing would be measured for this long
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("robust-metrics selftest: fault "), err
    assert message in err and "Traceback" not in err


def test_well_formed_faults_still_parse() -> None:
    assert faults("compute:slow=0.5,memory:offset=12,communication:rank=1;delay=0 , gpu") == {
        "compute": {"slow": "0.5"}, "memory": {"offset": "12"},
        "communication": {"rank": "1", "delay": "0"}, "gpu": {}}


def test_the_help_names_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["selftest", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for word in ("--quick", "compute", "memory", "communication", "gpu", "--expect-digest",
                 "MASTER_ADDR"):
        assert word in text


@pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root (install -o root)")
@pytest.mark.parametrize(("fault", "code"), [("", 0), ("memory", 1), ("nope", 0)])
def test_the_slurm_prolog_fails_only_on_a_failed_check(tmp_path: Path, fault: str,
                                                        code: int) -> None:
    """A failed check fails the prolog (Slurm drains the node); a self-test that cannot run
    (here: an unknown fault, exit 2) lets the job go ahead."""
    import subprocess

    from tests.support import ROOT

    env = {**os.environ, "ROBUST_METRICS_DIR": str(tmp_path / "rm"), "SLURM_JOB_ID": "42",
           "ROBUST_SELFTEST_FAULT": fault,
           "ROBUST_METRICS_SELFTEST": f"{sys.executable} -m robust_metrics selftest --quick "
                                      "--check memory --memory-bytes 65536"}
    done = subprocess.run(["bash", str(ROOT / "exporters" / "slurm" / "prolog.sh")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert ("node self-test failed" in done.stderr) == (code == 1)
