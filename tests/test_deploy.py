"""The deployment files in exporters/ (the node exporter and its scraping) and deploy/ (the rest)
are valid for the tools that read them."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from robust_metrics import rules
from tests.support import ROOT, require_binary

EXPORTERS = ROOT / "exporters"
DEPLOY = ROOT / "deploy"


SCRAPE = EXPORTERS / "prometheus" / "scrape.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"


def test_scrape_config_passes_promtool() -> None:
    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "check", "config", str(SCRAPE)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def _jobs(path: Path) -> dict[str, dict]:
    return {job["job_name"]: job for job in yaml.safe_load(path.read_text())["scrape_configs"]}


def test_complete_prometheus_config_passes_promtool_with_the_rendered_rules(
        tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml starts as is once `robust-metrics rules` has written the
    rule file it names: promtool loads the config, finds that file and checks every rule."""
    promtool = require_binary("promtool")
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["rule_files"] == ["rules.yml"]
    [manager] = config["alerting"]["alertmanagers"]
    assert manager["static_configs"] == [{"targets": ["127.0.0.1:9093"]}]
    shutil.copy(PROMETHEUS, tmp_path / "prometheus.yml")
    missing = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "rules.yml" in missing.stdout + missing.stderr
    done = subprocess.run([sys.executable, "-m", "robust_metrics", "rules", "--out",
                           str(tmp_path / "rules.yml")], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    rendered = yaml.safe_load((tmp_path / "rules.yml").read_text())["groups"]
    count = sum(len(group["rules"]) for group in rendered)
    assert "SUCCESS: 1 rule files found" in result.stdout, result.stdout
    assert f"SUCCESS: {count} rules found" in result.stdout, result.stdout


def test_the_bridge_is_scraped_where_its_policy_listens() -> None:
    """A restart waits until Prometheus has scraped the bridge's stop notice: both shipped
    configs scrape the bridge at the address examples/bridge.yaml listens on."""
    listen = yaml.safe_load((ROOT / "examples" / "bridge.yaml").read_text())["listen"]
    for path in (SCRAPE, PROMETHEUS):
        bridge = _jobs(path)["robust-metrics-bridge"]
        assert bridge["static_configs"] == [
            {"targets": [f"{listen['host']}:{listen['port']}"]}], path


def test_the_complete_config_scrapes_as_the_shipped_scrape_config() -> None:
    """One set of scrape jobs: the complete config differs from scrape.yml only in where the
    sidecar target files live (beside it, not under /etc)."""
    shipped, complete = _jobs(SCRAPE), _jobs(PROMETHEUS)
    assert set(shipped) == set(complete) == {"robust-metrics-sidecar", "robust-metrics-bridge"}
    for name, job in shipped.items():
        other = dict(complete[name])
        if "file_sd_configs" in job:
            [mine], [theirs] = job["file_sd_configs"], other.pop("file_sd_configs")
            assert Path(mine["files"][0]).name == Path(theirs["files"][0]).name
            assert {**mine, "files": None} == {**theirs, "files": None}
        assert {k: v for k, v in job.items() if k != "file_sd_configs"} == other, name


@pytest.mark.parametrize("path", [SCRAPE, PROMETHEUS], ids=["scrape", "complete"])
def test_instance_is_the_targets_node_name_as_the_comment_says(path: Path,
                                                                tmp_path: Path) -> None:
    """promtool runs the sidecar job's relabelling: a target listed by host name gets that
    name as `instance`, a target with its own `instance` label keeps it, the loopback target
    reads 127.0.0.1 (as its comment warns)."""
    promtool = require_binary("promtool")
    job = _jobs(path)["robust-metrics-sidecar"]
    job.pop("file_sd_configs")  # promtool 2.42's file discovery panics in check service-discovery
    job["static_configs"] += [{"targets": ["gpu-001:9741", "gpu-002"]},
                              {"targets": ["10.0.0.5:9741"], "labels": {"instance": "gpu-003"}}]
    (tmp_path / "sd.yml").write_text(yaml.safe_dump({"scrape_configs": [job]}))
    # static targets only: promtool waits its whole --timeout for discovery results
    result = subprocess.run([promtool, "check", "service-discovery", "--timeout=1s",
                             str(tmp_path / "sd.yml"), "robust-metrics-sidecar"],
                            capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    instances = {t["labels"]["__address__"]: t["labels"]["instance"]
                 for t in json.loads(result.stdout)}
    assert instances == {"127.0.0.1:9741": "127.0.0.1", "gpu-001:9741": "gpu-001",
                         "gpu-002:80": "gpu-002", "10.0.0.5:9741": "gpu-003"}


def test_daemonset_can_see_ranks_dump_stacks_and_read_sysfs_read_only() -> None:
    docs = list(yaml.safe_load_all((EXPORTERS / "kubernetes" / "sidecar.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert {"DaemonSet", "Service", "PodMonitor"} <= set(kinds)
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    container = pod["containers"][0]
    # SYS_PTRACE (stacks) and nothing else: the sidecar owns the folder it removes files from
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                            "add": ["SYS_PTRACE"]}
    assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["sys"]["readOnly"] is True
    assert "--path.sysfs=/host/sys" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = kinds["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"]
    assert port == container["ports"][0]["name"]
    labels = pod.get("labels") or kinds["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert kinds["Service"]["spec"]["selector"] == labels


def _prolog(directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROBUST_METRICS_DIR": str(directory), "SLURM_JOB_ID": "41"}
    return subprocess.run(["bash", str(EXPORTERS / "slurm" / "prolog.sh")], env=env,
                           capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root (install -o root)")
def test_slurm_prolog_makes_a_sticky_folder_nobody_lists_and_moves_planted_links_aside(
        tmp_path: Path) -> None:
    folder = tmp_path / "rm"
    outside = tmp_path / "outside"
    outside.mkdir()
    folder.mkdir()
    (folder / "ranks").symlink_to(outside)  # planted by a job before the prolog ran
    done = _prolog(folder)
    assert done.returncode == 0, done.stderr
    modes = {name: stat.S_IMODE((folder / name).lstat().st_mode)
             for name in (".", "ranks", "control")}
    assert modes == {".": 0o1733, "ranks": 0o1733, "control": 0o755}
    assert not (folder / "ranks").is_symlink() and os.listdir(outside) == []
    assert (folder / "ranks" / ".job-41").exists()
    assert any(name.startswith("ranks.untrusted.") for name in os.listdir(folder))
    assert _prolog(folder).returncode == 0  # a second job on the node


def test_slurm_scripts_parse() -> None:
    for script in (EXPORTERS / "slurm").glob("*.sh"):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                                timeout=10)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_systemd_unit_runs_the_sidecar_on_loopback() -> None:
    text = (EXPORTERS / "systemd" / "robust-metrics-sidecar.service").read_text()
    assert "robust-metrics sidecar" in text and "--listen 127.0.0.1:9741" in text
    assert "RestartPreventExitStatus=2 3" in text
    options = dict(line.split("=", 1) for line in text.splitlines()
                   if "=" in line and not line.startswith("#") and not line.startswith(" "))
    assert options["RuntimeDirectoryMode"] == "1733"
    assert options["CapabilityBoundingSet"] == "CAP_SYS_PTRACE"
    for hardening in ("NoNewPrivileges", "ProtectKernelTunables", "ProtectKernelModules",
                      "ProtectControlGroups", "RestrictNamespaces", "RestrictSUIDSGID",
                      "LockPersonality", "RestrictRealtime"):
        assert options[hardening] == "yes", hardening
    analyzer = shutil.which("systemd-analyze")
    if analyzer:
        result = subprocess.run([analyzer, "verify", "--man=no", str(EXPORTERS / "systemd" /
                                                                     "robust-metrics-sidecar.service")],
                                capture_output=True, text=True, timeout=30)
        # the ExecStart binary does not exist here; anything else is a unit error
        errors = [ln for ln in result.stderr.splitlines() if "robust-metrics" not in ln
                  or "Executable" not in ln]
        assert not [e for e in errors if "error" in e.lower()], result.stderr


VMAGENT = EXPORTERS / "vmagent"
VM = DEPLOY / "victoriametrics"


def _unit_flags(unit: Path, binary: str) -> list[str]:
    """The `-flag=value` arguments of a unit's ExecStart, with ${VAR} left as written."""
    text = unit.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith(f"ExecStart=/usr/bin/{binary}"))
    return line.split()[1:]


def test_vmagent_shards_read_the_shipped_scrape_config(tmp_path: Path) -> None:
    """Each vmagent shard starts from exporters/prometheus/scrape.yml unchanged, with the flags of
    its unit; the Kubernetes StatefulSet's config is valid for vmagent as well."""
    vmagent = require_binary("vmagent")
    flags = _unit_flags(VMAGENT / "vmagent@.service", "vmagent")
    assert "-promscrape.cluster.memberNum=%i" in flags
    assert "-promscrape.cluster.membersCount=${SHARDS}" in flags
    env = dict(ln.split("=", 1) for ln in (VMAGENT / "vmagent.env").read_text().splitlines()
               if ln and not ln.startswith("#"))
    local = [f.replace("${SHARDS}", env["SHARDS"]).replace("%i", "1")
             for f in flags if f.startswith("-promscrape.")]
    local = [f"-promscrape.config={EXPORTERS / 'prometheus' / 'scrape.yml'}"
             if f.startswith("-promscrape.config=") else f for f in local]
    result = subprocess.run([vmagent, "-dryRun", *local], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all((VMAGENT / "kubernetes.yaml").read_text())}
    (tmp_path / "scrape.yml").write_text(docs["ConfigMap"]["data"]["scrape.yml"])
    result = subprocess.run([vmagent, "-dryRun", f"-promscrape.config={tmp_path / 'scrape.yml'}"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    args = docs["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["args"]
    count = next(a for a in args if a.startswith("-promscrape.cluster.membersCount="))
    assert int(count.split("=")[1]) == docs["StatefulSet"]["spec"]["replicas"]


def test_vmalert_accepts_the_shipped_rules(tmp_path: Path) -> None:
    """vmalert parses every shipped rule and template (MetricsQL and Go templates, as in the
    unit's defaults) and the unit restores alert state and notifies Alertmanager."""
    vmalert = require_binary("vmalert")
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(rules.render(rules.load_groups()))
    result = subprocess.run([vmalert, "-dryRun", f"-rule={rules_file}"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    flags = _unit_flags(VM / "vmalert.service", "vmalert")
    for needed in ("-remoteWrite.url=", "-remoteRead.url=", "-notifier.url=", "-rule="):
        assert any(f.startswith(needed) for f in flags), needed


def test_pytorchjob_example_projects_the_annotations_where_the_hook_reads_them() -> None:
    from robust_metrics.hooks.config import WatchOptions

    k8s = pytest.importorskip("kubernetes.client", reason="the kubernetes extra is not installed")
    job = yaml.safe_load((DEPLOY / "kubernetes" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    for role in ("Master", "Worker"):
        template = job["spec"]["pytorchReplicaSpecs"][role]["template"]
        model = k8s.V1PodTemplateSpec.from_dict(template)  # fields and types as the API has them
        assert k8s.ApiClient().sanitize_for_serialization(model) == template
        pod = template["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        [volume] = [v for v in pod["volumes"] if "downwardAPI" in v]
        [item] = volume["downwardAPI"]["items"]
        assert item["fieldRef"]["fieldPath"] == "metadata.annotations"
        [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        projected = f"{mount['mountPath']}/{item['path']}"
        options = WatchOptions.resolve(env={k: v for k, v in env.items() if v})
        assert options.pod_annotations == projected
        assert options.metrics_dir == "/run/robust-metrics"
