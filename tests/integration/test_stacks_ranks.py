"""Hang localisation on real gloo ranks with the real py-spy, sidecar and Prometheus.

Scenarios: one rank blocked in data loading while the others wait in all_reduce (named,
with its node, through every source); a healthy job and a job whose ranks all wait in the same
collective (nobody named); two ranks blocked in two places (both named); a dead pid and an
unreachable sidecar (reported, the rest analysed); Flight Recorder dumps (the rank that skipped
the last collective).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import pytest

from robust_metrics import cli
from robust_metrics.analysis import stacks_sources
from robust_metrics.analysis.flight_recorder import analyse_paths
from robust_metrics.bridge import actions as bridge_actions
from robust_metrics.sidecar.stacks import find_py_spy
from tests.prometheus_fixture import PrometheusServer
from tests.support import ROOT, RankJob, SidecarProcess, free_port, wait_until

TRAIN = ROOT / "tests" / "stacks_train.py"
FR_JOB = ROOT / "tests" / "fr_job.py"
RUN = "stacks-run"
TOKEN = "stacks-token"
QUIET = ["--no-collector.nvml", "--no-collector.nccl", "--no-collector.nic"]


@pytest.fixture(scope="module", autouse=True)
def _py_spy() -> None:
    if find_py_spy() is None:
        pytest.skip("py-spy not installed (pip install robust-metrics[sidecar])")


def stacks(*args: str) -> tuple[int, str]:
    """Run `robust-metrics stacks ARGS` in-process; (exit status, stdout)."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(["stacks", *args])
    return code, out.getvalue()


def stacks_json(*args: str) -> tuple[int, dict]:
    code, text = stacks(*args, "--json")
    return code, json.loads(text)


class Job:
    """4 gloo ranks of stacks_train.py on two pretend nodes (ranks 0-1: node0, 2-3: node1)."""

    def __init__(self, root: Path, args: list[str], nproc: int = 4) -> None:
        self.metrics = root / "metrics"
        self.metrics.mkdir()
        logs = root / "logs"
        logs.mkdir()
        self.ranks = RankJob(nproc, args, script=TRAIN, log_dir=logs, run=RUN,
                             env={"ROBUST_METRICS_DIR": str(self.metrics)},
                             rank_env=lambda r: {"ROBUST_METRICS_NODE": f"node{r // 2}"})

    def wait_for(self, text: str, count: int, settle: float = 1.0) -> None:
        """Until `count` ranks logged `text`, then `settle` s for their peers to block."""
        try:
            wait_until(lambda: self.ranks.logs().count(text) >= count, timeout=120,
                       message=f"{count} rank(s) logging {text!r}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.ranks.logs()}") from None
        wait_until(lambda: len(list((self.metrics / "ranks").glob("*.json"))) >= self.ranks.nproc,
                   timeout=30, message="rank identity files")
        time.sleep(settle)


@pytest.fixture
def job(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Job]:
    started = Job(tmp_path, list(request.param))
    try:
        yield started
    finally:
        started.ranks.kill()


@pytest.fixture(scope="module")
def data_stall(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """Rank 2 blocks in load_batch at step 5; ranks 0, 1, 3 wait in all_reduce."""
    started = Job(tmp_path_factory.mktemp("data-stall"), ["--data-stall-rank", "2"])
    try:
        started.wait_for("rank 2: stalled in load_batch", 1)
        yield started
    finally:
        started.ranks.kill()


def test_rank_blocked_in_data_loading_is_named_with_its_node(data_stall: Job) -> None:
    code, report = stacks_json("--metrics-dir", str(data_stall.metrics), "--samples", "3",
                               "--interval", "0.3")
    assert code == 1, report
    assert report["run"] == RUN and report["hung"] is True
    assert report["suspect_ranks"] == [2]
    assert report["nodes"] == ["node1"]
    (s,) = report["suspects"]
    assert (s["rank"], s["node"], s["pid"], s["local_rank"]) == (2, "node1",
                                                                 data_stall.ranks.pids[2], 2)
    main = [g for g in report["groups"] if g["role"] == "main"]
    assert [(g["ranks"], g["healthy"]) for g in main] == [([0, 1, 3], True), ([2], False)]
    assert main[1]["signature"][:2] == ["_read_from_slow_storage (stacks_train.py)",
                                        "load_batch (stacks_train.py)"]
    assert "all_reduce (torch/distributed/distributed_c10d.py)" in main[0]["signature"]
    assert report["errors"] == [] and report["missing_ranks"] == []
    # the readable report says the same
    code, text = stacks("--metrics-dir", str(data_stall.metrics), "--samples", "2",
                        "--interval", "0.2")
    assert code == 1
    assert "rank 2 on node node1" in text and "SUSPECT NODES: node1" in text
    assert "main thread in _read_from_slow_storage (stacks_train.py)" in text


def test_dead_pid_is_reported_and_the_rest_analysed(data_stall: Job) -> None:
    exited = subprocess.Popen(["true"])
    exited.wait(timeout=30)
    gone = exited.pid
    pids = [*data_stall.ranks.pids, gone]
    code, report = stacks_json(*[f"--pid={p}" for p in pids], "--samples", "2",
                               "--interval", "0.2")
    assert code == 1
    assert report["suspect_ranks"] == [f"pid:{data_stall.ranks.pids[2]}@?"]
    assert report["ranks_analysed"] == 4
    assert report["errors"] == [{"rank": None, "pid": gone, "node": None,
                                 "source": f"pid {gone}", "error": f"no such process {gone}"}]


def test_through_the_sidecar_and_prometheus_with_one_sidecar_unreachable(
        data_stall: Job, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    unreachable = f"127.0.0.1:{free_port()}"
    with SidecarProcess(data_stall.metrics, [*QUIET, "--token-file", str(token), "--node",
                                             "gpu-node-7"],
                        log_path=tmp_path / "sidecar.log") as sidecar:
        sidecar.wait_ready()
        code, report = stacks_json(sidecar.url, f"http://{unreachable}", "--token-file",
                                   str(token), "--samples", "2", "--interval", "0.3")
        assert code == 1, (report, sidecar.log_tail())
        assert report["suspect_ranks"] == [2] and report["nodes"] == ["gpu-node-7"]
        assert report["ranks_analysed"] == 4
        # the same identity and topology as read from the folder itself (node: the sidecar's name)
        code, local = stacks_json("--metrics-dir", str(data_stall.metrics), "--samples", "2",
                                  "--interval", "0.3")
        assert code == 1, local
        coordinates = ("rank", "pid", "local_rank", "dp_rank", "pp_rank", "tp_rank")
        assert [{k: s[k] for k in coordinates} for s in report["suspects"]] == [
            {k: s[k] for k in coordinates} for s in local["suspects"]] == [
            {"rank": 2, "pid": data_stall.ranks.pids[2], "local_rank": 2, "dp_rank": 0,
             "pp_rank": 0, "tp_rank": 1}]
        assert report["topology"] == local["topology"] != {}
        assert report["missing_ranks"] == local["missing_ranks"] == []
        # and through the bridge, which analyses the same sidecar's /debug/stacks answer
        dump = httpx.get(f"{sidecar.url}/debug/stacks", timeout=60,
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()
        analysis, how = bridge_actions._analyse([dump])
        assert how == "analysed" and analysis is not None
        assert [{k: s[k] for k in coordinates} for s in analysis["suspects"]] == [
            {k: s[k] for k in coordinates} for s in local["suspects"]]
        assert analysis["suspects"][0]["node"] == "gpu-node-7"
        assert analysis["topology"] == local["topology"]
        (error,) = report["errors"]
        assert error["source"] == f"http://{unreachable}/debug/stacks"
        assert "cannot reach" in error["error"]
        # a wrong token is an error of that sidecar, not a crash
        code, report = stacks_json(sidecar.url, "--token", "wrong", "--samples", "1")
        assert code == 3 and "HTTP 401" in report["errors"][0]["error"]

        # Prometheus scrapes the sidecar (and a sidecar that is down): discovery finds both
        sidecar_target = sidecar.url.removeprefix("http://")
        with PrometheusServer(tmp_path / "prometheus", [sidecar_target, unreachable],
                              job="robust-sidecar") as prom:
            wait_until(lambda: len(prom.query(f'robust_rank_info{{run="{RUN}"}}')) == 4,
                       timeout=60, message="rank info scraped")
            wait_until(lambda: len(prom.query("up == 0")) == 1, timeout=30,
                       message="the unreachable target marked down")
            code, report = stacks_json("--prometheus", prom.url, "--token-file", str(token),
                                       "--samples", "2", "--interval", "0.3")
            assert code == 1, report
            assert report["run"] == RUN and report["suspect_ranks"] == [2]
            assert report["suspects"][0]["node"] == "gpu-node-7"
            assert [e["source"] for e in report["errors"]] == [
                f"http://{unreachable}/debug/stacks"]
            assert stacks("--prometheus", prom.url, "--run", "no-such-run")[0] == 2


@pytest.mark.parametrize("job", [[]], indirect=True)
def test_healthy_job_names_nobody(job: Job) -> None:
    job.wait_for("step 20", 4, settle=0)
    code, report = stacks_json("--metrics-dir", str(job.metrics))
    assert code == 0, report
    assert report["hung"] is False and report["suspects"] == []
    assert report["ranks_analysed"] == 4 and report["stable_ranks"] == []
    assert all(p.poll() is None for p in job.ranks.procs)  # dumping did not hurt the ranks
    before = job.ranks.logs().count(": step ")
    wait_until(lambda: job.ranks.logs().count(": step ") > before, timeout=60,
               message="training goes on after the dumps")


@pytest.mark.parametrize("job", [["--deadlock"]], indirect=True)
def test_all_ranks_in_the_same_collective_names_nobody(job: Job) -> None:
    job.wait_for("stalled in deadlock", 4)
    code, report = stacks_json("--metrics-dir", str(job.metrics), "--interval", "0.3")
    assert code == 0, report
    assert report["hung"] is True and report["suspects"] == [] and report["nodes"] == []
    (main,) = [g for g in report["groups"] if g["role"] == "main"]
    assert main["ranks"] == [0, 1, 2, 3] and main["state"] == "stuck"
    assert main["signature"][:1] == ["all_reduce (torch/distributed/distributed_c10d.py)"]


@pytest.mark.parametrize("job", [["--data-stall-rank", "1", "--ckpt-stall-rank", "2",
                                  "--ckpt-stall-step", "4"]], indirect=True)
def test_two_ranks_in_two_places_are_both_named(job: Job) -> None:
    job.wait_for("stalled in", 2)
    code, report = stacks_json("--metrics-dir", str(job.metrics), "--interval", "0.3")
    assert code == 1, report
    assert report["suspect_ranks"] == [1, 2]
    assert report["nodes"] == ["node0", "node1"]
    where = {s["rank"]: s["signatures"]["main"][0] for s in report["suspects"]}
    assert where == {1: "_read_from_slow_storage (stacks_train.py)",
                     2: "_flush_to_remote_storage (stacks_train.py)"}


@pytest.mark.parametrize("stall", ["--data-stall-rank", "--compute-stall-rank"])
def test_two_rank_ddp_hang_names_the_rank_that_is_not_in_backward(
        tmp_path: Path, stall: str) -> None:
    # DDP reduces gradients in C++ at the end of backward(): rank 0's stack shows no collective
    job = Job(tmp_path, ["--ddp", stall, "1"], nproc=2)
    try:
        job.wait_for("rank 1: stalled in", 1, settle=2.0)
        code, report = stacks_json("--metrics-dir", str(job.metrics), "--interval", "0.3")
        assert code == 1, report
        assert report["hung"] is True and report["suspect_ranks"] == [1], report["notes"]
        assert report["nodes"] == ["node0"]
        assert any("rank(s) 0 taken as waiting" in n for n in report["notes"])
        # the bridge's dump_stacks action: one round of the node's answer, the same analysis
        identities = stacks_sources.identities_from_dir(str(job.metrics))
        ranks = stacks_sources.local_dumps(sorted(identities), identities, locals_=True,
                                           native=False, timeout=15)
        analysis, how = bridge_actions._analyse([{"node": "node0", "ranks": ranks}])
        assert how == "analysed" and analysis is not None
        assert analysis["suspect_ranks"] == [1] and analysis["hung"] is None
    finally:
        job.ranks.kill()


def test_flight_recorder_names_the_rank_missing_from_the_last_collective(tmp_path: Path) -> None:
    out = tmp_path / "fr"
    out.mkdir()
    fr = RankJob(3, ["--out", str(out), "--skip-rank", "1"], script=FR_JOB,
                 env={"TORCH_FR_BUFFER_SIZE": "64"}, log_dir=tmp_path)
    try:
        assert fr.wait(timeout=120) == [0, 0, 0], fr.logs()
    finally:
        fr.kill()
    report = analyse_paths([str(out)])
    (group,) = report["groups"]
    assert group["ranks"] == [0, 1, 2] and group["last_seq"] == 4
    assert group["last_collective"] == "gloo:all_reduce"
    assert group["missing_ranks"] == [1] and report["missing_ranks"] == [1]
    assert group["seq_by_rank"] == {"0": 4, "1": 3, "2": 4}
    # through the CLI, next to the stacks (here of a local process)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); "
                                "time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert sleeper.stdout is not None and sleeper.stdout.readline()
        code, text = stacks("--pid", str(sleeper.pid), "--samples", "1",
                            "--flight-recorder", str(out))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert code == 0, text
    assert "process group 0: last collective gloo:all_reduce (seq 4); missing ranks 1" in text
