"""`robust-metrics job`: a run started from the command line is one the bridge can restart and
stop, because both build the `local` scheduler from the same policy file; bad input exits 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from robust_metrics.bridge.config import load
from robust_metrics.bridge.service import Bridge
from robust_metrics.cli import main
from tests.support import process_gone

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def policy(folder: Path, schedulers: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bridge.yaml"
    path.write_text(yaml.safe_dump({
        "database": "bridge.db", "auth": {"bearer_token": "t"}, "schedulers": schedulers,
        "default_scheduler": next(iter(schedulers)),
        "rules": [{"match": {"action": "restart"}, "actions": ["restart"]}]}))
    return path


def job(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The console command, as a user runs it: its own process, from another folder."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "robust_metrics", "job", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=60)



def test_a_run_started_by_the_command_is_restarted_and_stopped_by_the_bridge(
        tmp_path: Path) -> None:
    # relative state and log folders: both sides resolve them against the policy's folder
    config = policy(tmp_path / "policy", {"local": {"type": "local", "command": SLEEPER,
                                                    "stop_timeout_s": 5}})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    started = job("start", "--config", str(config), "run-1", cwd=elsewhere)
    assert started.returncode == 0, started.stderr
    assert "started run run-1 as pid" in started.stdout
    bridge = Bridge(load(config))
    local: Any = bridge.schedulers["local"]
    try:
        first = local.state("run-1")["pid"]
        assert local.running("run-1")
        assert local.state_dir == (tmp_path / "policy" / "local-scheduler").resolve()
        status = job("status", "--config", str(config), "run-1", cwd=elsewhere)
        assert status.returncode == 0 and f"running as pid {first}" in status.stdout

        restarted = local.restart("run-1", "test", key="incident#0")
        assert restarted.ok and restarted.data["stopped_pid"] == first, restarted.detail
        second = local.state("run-1")["pid"]
        assert second != first and process_gone(first) and local.running("run-1")
        status = job("status", "--config", str(config), "run-1", cwd=elsewhere)
        assert status.returncode == 0 and f"running as pid {second}" in status.stdout
        assert "generation 2" in status.stdout

        assert local.cancel("run-1", "test").ok
        assert process_gone(second)
        status = job("status", "--config", str(config), "run-1", cwd=elsewhere)
        assert status.returncode == 3 and "not running" in status.stdout

        # and the other way round: the command stops what the bridge (re)started
        local.restart("run-1", "test", key="incident#1")
        third = local.state("run-1")["pid"]
        stopped = job("stop", "--config", str(config), "run-1", cwd=elsewhere)
        assert stopped.returncode == 0 and f"stopped run run-1 (pid {third})" in stopped.stdout
        assert process_gone(third) and not local.running("run-1")
    finally:
        local.cancel("run-1", "cleanup")
        bridge.close()


def test_start_twice_keeps_one_process_and_status_of_an_unknown_run_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = policy(tmp_path, {"ops": {"type": "webhook", "url": "http://127.0.0.1:1/"},
                               "here": {"type": "local", "command": SLEEPER,
                                        "state_dir": "state"}})
    local: Any = load(config).schedulers["here"].create()
    try:
        assert main(["job", "start", "--config", str(config), "r"]) == 0
        pid = local.state("r")["pid"]
        assert main(["job", "start", "--config", str(config), "--scheduler", "here", "r"]) == 0
        assert local.state("r")["pid"] == pid and local.state("r")["generation"] == 1
        assert "already running" in capsys.readouterr().out
        assert main(["job", "status", "--config", str(config), "other"]) == 3
        assert "never started" in capsys.readouterr().out
    finally:
        local.cancel("r", "cleanup")


@pytest.mark.parametrize(("schedulers", "extra", "message"), [
    ({"ops": {"type": "webhook", "url": "http://127.0.0.1:1/"}}, [],
     "needs exactly one scheduler of type local, it has none"),
    ({"a": {"type": "local", "command": "true"}, "b": {"type": "local", "command": "true"}}, [],
     "it has 2: a, b; choose one with --scheduler"),
    ({"a": {"type": "local", "command": "true"}}, ["--scheduler", "nope"],
     "no scheduler named 'nope' (defined: a)"),
    ({"a": {"type": "local", "command": "true"},
      "ops": {"type": "webhook", "url": "http://127.0.0.1:1/"}}, ["--scheduler", "ops"],
     "scheduler 'ops' is of type webhook, not local"),
    ({"a": {"type": "local", "command": "true", "stop_timeout": 3}}, [],
     "unknown key(s) stop_timeout"),
])
def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         schedulers: dict[str, Any], extra: list[str],
                                         message: str) -> None:
    config = policy(tmp_path, schedulers)
    for action in ("start", "stop", "status"):
        assert main(["job", action, "--config", str(config), *extra, "r"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "local-scheduler").exists()  # nothing was started or written


def test_a_missing_or_invalid_policy_and_missing_arguments_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["job", "start", "--config", str(tmp_path / "none.yaml"), "r"]) == 2
    err = capsys.readouterr().err
    assert "invalid policy: cannot read policy file" in err and err.count("\n") == 1
    (tmp_path / "bad.yaml").write_text("schedulers: [\n")
    assert main(["job", "status", "--config", str(tmp_path / "bad.yaml"), "r"]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    config = policy(tmp_path, {"a": {"type": "local", "command": "true"}})
    assert main(["job", "start", "--config", str(config), " "]) == 2
    assert "RUN must not be empty" in capsys.readouterr().err
    for args in (["job"], ["job", "start", "r"], ["job", "restart", "--config", str(config), "r"]):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2


def test_a_command_that_cannot_start_exits_1(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = policy(tmp_path, {"a": {"type": "local",
                                     "command": [str(tmp_path / "no-such-program")]}})
    assert main(["job", "start", "--config", str(config), "r"]) == 1
    err = capsys.readouterr().err
    assert "cannot start" in err and "no-such-program" in err


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    from robust_metrics import __version__

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                              .read_text())
    assert __version__ == pyproject["project"]["version"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"robust-metrics {__version__}\n"
