"""The `slurm` adapter without Slurm: config validation, refused job ids and node names, token
sources, and an unreachable slurmrestd or missing CLI as scheduler errors. Against a real Slurm:
tests/integration/test_slurm_adapter.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from robust_metrics.bridge.schedulers import base
from robust_metrics.bridge.schedulers.slurm import SlurmScheduler


# ---------------------------------------------------------------------- no Slurm needed
def test_registry_builds_the_adapter() -> None:
    adapter = base.create("slurm", {"url": "http://127.0.0.1:1", "token": "t"})
    assert isinstance(adapter, SlurmScheduler) and isinstance(adapter, base.Scheduler)
    assert "slurm" in base.names()


@pytest.mark.parametrize(("config", "message"), [
    ({"url": "slurmrestd:6820"}, "must be an http"),
    ({"api_version": "0.0.38"}, "must look like v0.0.38"),
    ({"token": "a", "token_file": "b"}, "one of"),
    ({"signal_scope": "batch"}, "`full` or `steps`"),
    ({"timeout_s": 0}, "must be positive"),
    ({"timeout_s": "soon"}, "must be a number"),
    ({"urls": "http://x"}, "unknown key"),
])
def test_bad_config_is_rejected(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SlurmScheduler(config)


@pytest.mark.parametrize("run", ["", "abc", "12 34", "12;rm", "-1", "pytorchjob-7"])
def test_runs_that_are_not_job_ids_are_refused(run: str) -> None:
    with pytest.raises(base.SchedulerError, match="not a Slurm job id"):
        SlurmScheduler({}).signal(run, signal.SIGUSR1)


def test_node_names_that_could_smuggle_arguments_are_refused() -> None:
    for node in ("", "n1 State=RESUME", "-h", "n=1"):
        with pytest.raises(base.SchedulerError, match="not a node name"):
            SlurmScheduler({}).drain_node(node, "x")


def test_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "jwt").write_text("SLURM_JWT=from-file\n")
    assert SlurmScheduler({"token_file": "jwt"}, base_dir=tmp_path).token() == "from-file"
    monkeypatch.setenv("MY_JWT", "from-env")
    assert SlurmScheduler({"token_env": "MY_JWT"}).token() == "from-env"
    monkeypatch.delenv("SLURM_JWT", raising=False)
    with pytest.raises(base.SchedulerError, match="no JWT"):
        SlurmScheduler({"url": "http://127.0.0.1:1"}).token()
    with pytest.raises(base.SchedulerError, match="cannot read token_file"):
        SlurmScheduler({"token_file": str(tmp_path / "missing")}).token()


def test_unreachable_slurmrestd_is_a_scheduler_error() -> None:
    from tests.support import free_port

    adapter = SlurmScheduler({"url": f"http://127.0.0.1:{free_port()}", "token": "t",
                              "timeout_s": 2})
    with pytest.raises(base.SchedulerError, match="cannot reach slurmrestd"):
        adapter.cancel("1", "x")


def test_missing_cli_is_a_scheduler_error() -> None:
    adapter = SlurmScheduler({"scontrol": "/nonexistent/scontrol"})
    with pytest.raises(base.SchedulerError, match="not found"):
        adapter.restart("1", "x")
