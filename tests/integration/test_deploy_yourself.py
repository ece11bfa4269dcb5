"""docs/deploy-yourself.md, followed end to end at a time scale, so the page stays true.

The page's own shell runs where it matters: its bridge.yaml heredoc writes the policy, its
`robust-metrics job` commands start, show and stop the run, its `kill -STOP` line hangs rank 1.
The services are those of the page with their shipped files (deploy/prometheus/prometheus.yml,
alert_rules/alertmanager.yml with the token file), started through `robust_metrics.processes`
on free loopback ports instead of the page's fixed ones, at 1 s intervals with the rules
time-scaled by 1/15 (`robust-metrics rules --time-scale`), as the demo runs them. The hung job
must be named by RankHang, restarted once by the bridge after Prometheus saw its stop notice,
and resume from its checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from robust_metrics import cli, processes, rules
from tests.support import ROOT, free_port, process_gone, require_binary, wait_until

pytestmark = [
    pytest.mark.skipif("job" not in cli.COMMANDS, reason=(
        "`robust-metrics job start|stop|status` (a run started under the bridge's local "
        "scheduler, step 7 of docs/deploy-yourself.md) is not in this build yet")),
]
PAGE = ROOT / "docs" / "deploy-yourself.md"
RUN = "demo"
SCALE = 1 / 15  # the shipped rules are written for 15 s; this test runs at 1 s
PAGE_PORTS = {"sidecar": 9741, "prometheus": 9090, "alertmanager": 9093, "bridge": 9095}


def page_block(marker: str) -> str:
    """The page's shell block that contains `marker`."""
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"docs/deploy-yourself.md: one shell block with {marker!r}"
    return blocks[0]


def on_ports(text: str, ports: dict[str, int]) -> str:
    """`text` with the page's loopback ports (`127.0.0.1:9090`, `port: 9095`) replaced by this
    test's."""
    for name, page_port in PAGE_PORTS.items():
        text = re.sub(rf"(127\.0\.0\.1:|port: ){page_port}\b", rf"\g<1>{ports[name]}", text)
    return text


def bash(script: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{script}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def job(action: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robust_metrics", "job", action, "--config",
                           "bridge.yaml", RUN], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def prometheus_config(ports: dict[str, int]) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml at 1 s, on this test's ports."""
    text = on_ports((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text(), ports)
    config = yaml.safe_load(text)
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s",
                        "scrape_timeout": "1s"}
    for job_config in config["scrape_configs"]:
        job_config.update(scrape_interval="1s", scrape_timeout="1s")
    return config


def alertmanager_config(folder: Path, ports: dict[str, int]) -> dict[str, Any]:
    """The page's sed of alert_rules/alertmanager.yml, with the demo's 1 s timers."""
    text = (ROOT / "alert_rules" / "alertmanager.yml").read_text().replace(
        "/etc/robust-metrics/bridge.token", str(folder / "token"))
    config = yaml.safe_load(on_ports(text, ports))
    config["route"].update(group_wait="1s", group_interval="2s", repeat_interval="1h")
    for child in config["route"]["routes"]:
        for key in ("group_wait", "group_interval"):
            if key in child:
                child[key] = config["route"][key]
    return config


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """The page's ~/robust-metrics-run; the run is stopped however the test ends."""
    run_dir = tmp_path / "robust-metrics-run"
    run_dir.mkdir()
    yield run_dir
    if (run_dir / "bridge.yaml").exists():
        job("stop", run_dir, {**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_page_takes_a_hung_job_to_a_restart(folder: Path) -> None:
    require_binary("prometheus")
    require_binary("prometheus-alertmanager", "alertmanager")
    ports = {name: free_port() for name in PAGE_PORTS}
    env = {**os.environ, "REPO": str(ROOT), "ROBUST_METRICS_DIR": str(folder / "metrics"),
           "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    bash("openssl rand -hex 32 > token && chmod 600 token", folder, env)  # step 2
    token = (folder / "token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}

    # step 6's policy, as the page writes it
    policy = page_block("cat > bridge.yaml").split("robust-metrics bridge --config")[0]
    bash(policy, folder, env)
    (folder / "bridge.yaml").write_text(on_ports((folder / "bridge.yaml").read_text(), ports))

    (folder / "prometheus").mkdir()
    (folder / "prometheus" / "rules.yml").write_text(
        rules.render(rules.load_groups(time_scale=SCALE)))
    services = [
        processes.sidecar(folder / "metrics", ["--token-file", str(folder / "token")],
                          port=ports["sidecar"], log_path=folder / "sidecar.log"),
        processes.Prometheus(folder / "prometheus", config=prometheus_config(ports),
                             port=ports["prometheus"], log_path=folder / "prometheus.log"),
        processes.alertmanager(folder / "alertmanager", alertmanager_config(folder, ports),
                               port=ports["alertmanager"], log_path=folder / "alertmanager.log"),
        processes.bridge(folder / "bridge.yaml", port=ports["bridge"], cwd=folder, env=env,
                         log_path=folder / "bridge.log"),
    ]
    started: list[processes.Service] = []
    try:
        for service in services:
            started.append(service.start())
        _follow_the_page(folder, env, ports, auth, services[1])
    finally:
        for service in reversed(started):
            service.stop()


def _steps(ports: dict[str, int], metric: str = "robust_steps_total") -> dict[str, float]:
    """rank -> value of `metric` for the run, as the sidecar serves it now."""
    text = httpx.get(f"http://127.0.0.1:{ports['sidecar']}/metrics", timeout=5).text
    return {s.labels["rank"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == metric and s.labels.get("run") == RUN}


def _follow_the_page(folder: Path, env: dict[str, str], ports: dict[str, int],
                     auth: dict[str, str], prometheus: Any) -> None:
    started = job("start", folder, env)  # step 7
    assert started.returncode == 0, started.stdout + started.stderr
    assert job("status", folder, env).returncode == 0
    prometheus.wait_for_targets_up(2, timeout=60)  # the sidecar and the bridge
    log = folder / "local-scheduler" / f"{RUN}.log"
    wait_until(lambda: (s := _steps(ports)) and len(s) == 2 and min(s.values()) >= 60, 240, 0.5,
               message=lambda: f"both ranks past step 60\n{log.read_text()[-3000:]}")

    # step 8: the page's own lines find rank 1's pid and stop it
    stopped_pid = int(bash(on_ports(page_block("kill -STOP"), ports) + 'echo "$PID"\n', folder,
                           env).split()[-1])
    try:
        _restarted_and_resumed(folder, env, ports, auth, stopped_pid)
    finally:
        _continue(stopped_pid)  # a stopped rank the restart left behind dies of its SIGTERM



def _continue(pid: int) -> None:
    if not process_gone(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _restarted_and_resumed(folder: Path, env: dict[str, str], ports: dict[str, int],
                           auth: dict[str, str], stopped_pid: int) -> None:
    log = folder / "local-scheduler" / f"{RUN}.log"

    def restarted() -> dict[str, Any] | None:
        rows = httpx.get(f"http://127.0.0.1:{ports['bridge']}/api/v1/actions", headers=auth,
                         timeout=10).json()["actions"]
        done = [r for r in rows if r["alertname"] == "RankHang" and r["status"] in (
            "done", "failed")]
        return done[0] if done else None

    row = wait_until(restarted, 180, 0.5, message=lambda: (
        f"RankHang to be restarted\n{(folder / 'bridge.log').read_text()[-3000:]}"))
    assert row["labels"]["rank"] == "1", row["labels"]
    steps = {s["action"]: s for s in row["steps"]}
    assert row["status"] == "done", row["steps"]
    assert list(steps) == ["dump_stacks", "restart"]  # a hang: no checkpoint first
    assert steps["restart"]["status"] == "success", steps
    assert steps["restart"]["data"]["stop_notice"].startswith("seen by Prometheus"), steps
    assert process_gone(stopped_pid), "the restart left the stopped rank behind"
    resumed = wait_until(lambda: re.findall(r"rank 0: resumed from step (\d+)", log.read_text()),
                         180, 0.5, message="the restarted job to resume from its checkpoint")
    assert int(resumed[-1]) >= 50
    wait_until(lambda: (s := _steps(ports, "robust_start_step")) and len(s) == 2 and all(
        v >= 50 for v in s.values()), 120, 0.5, message="the new ranks' start step")
    # one restart: the exits the bridge caused are not read as crashes
    rows = httpx.get(f"http://127.0.0.1:{ports['bridge']}/api/v1/actions", headers=auth,
                     timeout=10).json()["actions"]
    restarts = [r for r in rows if any(s["action"] == "restart" and s["status"] == "success"
                                       for s in r["steps"])]
    assert len(restarts) == 1, [(r["alertname"], r["status"]) for r in rows]

    # step 9
    stopped = job("stop", folder, env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert job("status", folder, env).returncode == 3
