"""The deployment files in deploy/ are valid for the tools that read them."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.support import ROOT, require_binary

DEPLOY = ROOT / "deploy"


def test_scrape_config_passes_promtool() -> None:
    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" /
                                                             "scrape.yml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_daemonset_can_see_ranks_dump_stacks_and_read_sysfs_read_only() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "sidecar.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert {"DaemonSet", "Service", "PodMonitor"} <= set(kinds)
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    container = pod["containers"][0]
    assert "SYS_PTRACE" in container["securityContext"]["capabilities"]["add"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["sys"]["readOnly"] is True
    assert "--path.sysfs=/host/sys" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = kinds["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"]
    assert port == container["ports"][0]["name"]
    labels = pod.get("labels") or kinds["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert kinds["Service"]["spec"]["selector"] == labels


def test_slurm_scripts_parse() -> None:
    for script in (DEPLOY / "slurm").glob("*.sh"):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                                timeout=10)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_systemd_unit_runs_the_sidecar_on_loopback() -> None:
    text = (DEPLOY / "systemd" / "robust-metrics-sidecar.service").read_text()
    assert "robust-metrics sidecar" in text and "--listen 127.0.0.1:9741" in text
    assert "RestartPreventExitStatus=2 3" in text
    analyzer = shutil.which("systemd-analyze")
    if analyzer:
        result = subprocess.run([analyzer, "verify", "--man=no", str(DEPLOY / "systemd" /
                                                                     "robust-metrics-sidecar.service")],
                                capture_output=True, text=True, timeout=30)
        # the ExecStart binary does not exist here; anything else is a unit error
        errors = [ln for ln in result.stderr.splitlines() if "robust-metrics" not in ln
                  or "Executable" not in ln]
        assert not [e for e in errors if "error" in e.lower()], result.stderr
