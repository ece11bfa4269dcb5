"""Ranks forked from one launcher (robust_metrics.forked_ranks) behave as ranks started each
with its own interpreter: their own pid, argv, environment and log; `__main__`; atexit handlers
and a traceback at exit; their exit status as `subprocess` reports it; nothing left after kill."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from robust_metrics.processes import RankJob, leftovers

SCRIPT = Path(__file__).parent.parent / "fixtures" / "ranks" / "rank_script.py"


def _job(tmp_path: Path, mode: str, nproc: int = 3) -> RankJob:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return RankJob(nproc, [mode, "--flag"], script=SCRIPT, log_dir=tmp_path / "logs",
                   env={"OUT": str(tmp_path)}, preload=("json",))


def test_each_forked_rank_runs_the_script_as_its_own_main(tmp_path: Path) -> None:
    with _job(tmp_path, "ok") as job:
        assert job.wait(60) == [0, 0, 0], job.logs()
    pids = job.pids
    assert len(set(pids)) == 3 and os.getpid() not in pids
    for rank, pid in enumerate(pids):
        assert (tmp_path / f"seen{rank}").read_text() == f"ok --flag|__main__|{pid}"
        assert (tmp_path / f"atexit{rank}").read_text() == "ran"
        assert f"rank {rank} started" in (tmp_path / "logs" / f"rank{rank}.log").read_text()


def test_an_uncaught_exception_is_exit_status_1_with_its_traceback_in_the_log(
        tmp_path: Path) -> None:
    with _job(tmp_path, "raise") as job:
        assert job.wait(60) == [0, 1, 0]
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "RuntimeError: rank 1 fails" in log
    assert (tmp_path / "atexit1").read_text() == "ran"


def test_a_killed_rank_reports_its_signal_and_stays_a_zombie_until_all_end(
        tmp_path: Path) -> None:
    """As an unwaited `Popen` child: the sidecar reads how a dead rank ended from its zombie."""
    with _job(tmp_path, "sleep", nproc=2) as job:
        victim = job.pids[1]
        os.kill(victim, signal.SIGKILL)
        assert job.procs[1].wait(30) == -signal.SIGKILL
        state = Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "Z"
        assert job.procs[0].poll() is None
    assert leftovers() == []
    assert not Path(f"/proc/{victim}").exists()  # reaped by the launcher, not left to init


def test_kill_ends_every_rank_and_the_launcher(tmp_path: Path) -> None:
    job = _job(tmp_path, "sleep", nproc=2)
    pids = job.pids
    os.kill(pids[0], signal.SIGSTOP)  # a stopped rank ends too
    job.kill()
    assert [p.poll() for p in job.procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert leftovers() == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_a_launcher_that_cannot_preload_fails_every_rank_with_its_reason(
        tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    with RankJob(2, ["ok"], script=SCRIPT, log_dir=tmp_path / "logs", env={"OUT": str(tmp_path)},
                 preload=("no_such_module_here",)) as job:
        assert job.wait(60) == [1, 1]
        with pytest.raises(RuntimeError, match="exited"):
            job.pids  # noqa: B018 - the property waits for the fork
    assert "No module named 'no_such_module_here'" in job.logs()
