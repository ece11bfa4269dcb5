"""The alert and recording rules: promtool checks and unit tests, schema names, conventions,
the rules command (plain, PrometheusRule, time scaling), and the Alertmanager routing example."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from robust_metrics import rules, schema
from tests.support import ROOT, require_binary

RULES = ROOT / "alert_rules"
TESTS = sorted((RULES / "tests").glob("*_test.yml"))
ALERTMANAGER = RULES / "alertmanager.yml"
ACTIONS = {"checkpoint", "restart", "dump_stacks", "drain_node", "none"}
# series Prometheus makes itself, not declared in the schema
PROMETHEUS_SERIES = {"up"}
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                "group_right", "offset", "bool", "inf", "nan"}

GROUPS = rules.load_groups()
ALERTS = rules.alerts(GROUPS)
RECORDS = rules.recording_rules(GROUPS)
NODE_SUMMARY_RECORDS = rules.recording_rules(
    g for g in GROUPS if g["name"] == rules.NODE_SUMMARY_GROUP)


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


# -- promtool ---------------------------------------------------------------------------------
def test_promtool_accepts_every_rule_file() -> None:
    promtool = require_binary("promtool")
    result = run(promtool, "check", "rules", *map(str, rules.rule_files(RULES)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    promtool = require_binary("promtool")
    assert TESTS, "no promtool unit tests in alert_rules/tests"
    result = subprocess.run([promtool, "test", "rules", *[t.name for t in TESTS]],
                            cwd=RULES / "tests", capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.parametrize("test_file", TESTS, ids=lambda p: p.name)
def test_unit_tests_evaluate_groups_in_file_order(test_file: Path) -> None:
    """Without group_eval_order promtool evaluates groups in a random order, and a rule reading
    another group's record sees this evaluation's value in one run and the last one in the
    next: a unit test must not pass or fail by chance. Every group of its rule files, in order."""
    spec = yaml.safe_load(test_file.read_text())
    groups = [g["name"] for f in spec["rule_files"]
              for g in yaml.safe_load((test_file.parent / f).read_text())["groups"]]
    if test_file.name.endswith("_stale_test.yml"):  # an order chosen to read records one
        assert sorted(spec.get("group_eval_order", [])) == sorted(groups)  # evaluation old
        assert spec["group_eval_order"] != groups
        return
    assert spec.get("group_eval_order") == groups


@pytest.mark.parametrize("scale", [1.0, 1 / 15, 4.0])
def test_rendered_rules_pass_promtool(tmp_path: Path, scale: float) -> None:
    promtool = require_binary("promtool")
    path = tmp_path / "rules.yml"
    path.write_text(rules.render(rules.load_groups(time_scale=scale)))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS) + len(RECORDS)} rules found" in result.stdout


# -- unit-test coverage -----------------------------------------------------------------------
def _unit_tests() -> list[dict[str, Any]]:
    return [t for path in TESTS for t in yaml.safe_load(path.read_text())["tests"]]


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    firing: dict[str, int] = {}
    silent: dict[str, int] = {}
    for test in _unit_tests():
        for case in test.get("alert_rule_test", []):
            bucket = firing if case.get("exp_alerts") else silent
            bucket[case["alertname"]] = bucket.get(case["alertname"], 0) + 1
    names = {a["alert"] for a in ALERTS}
    assert names - set(firing) == set(), "alerts never tested firing"
    assert names - set(silent) == set(), "alerts never tested silent"


def test_firing_unit_tests_check_every_label_and_annotation() -> None:
    by_name = {a["alert"]: a for a in ALERTS}
    for test in _unit_tests():
        for case in test.get("alert_rule_test", []):
            rule = by_name[case["alertname"]]
            for expected in case.get("exp_alerts") or []:
                assert set(rule["labels"]) <= set(expected["exp_labels"]), case["alertname"]
                assert set(expected["exp_annotations"]) == set(rule["annotations"]), \
                    case["alertname"]


def test_every_recording_rule_has_an_expression_test() -> None:
    """(The node summaries recorded where no sidecar runs are each held to the sidecar's values
    by a promtool test that tests/test_node_summaries.py writes from the collectors.)"""
    tested = " ".join(case["expr"] for test in _unit_tests()
                      for case in test.get("promql_expr_test", []))
    untested = [r["record"] for r in RECORDS if r not in NODE_SUMMARY_RECORDS
                and not re.search(rf"{re.escape(r['record'])}\b", tested)]
    assert not untested, f"recording rules without a promql_expr_test: {untested}"


# -- names ------------------------------------------------------------------------------------
def metric_names(expr: str) -> set[str]:
    """Series names an expression selects (functions, keywords and label names left out)."""
    text = re.sub(r"#[^\n]*", " ", expr)  # comments
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', text)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        if m.group(2) or m.group(1).lower() in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(1))
    return names


def _template_queries(text: str) -> list[str]:
    return [q.replace("%s", "x") for q in re.findall(r'printf "([^"]*)"', text)]


def _all_expressions() -> list[tuple[str, str]]:
    out = []
    for rule in ALERTS + RECORDS:
        name = rule.get("alert") or rule.get("record")
        out.append((name, rule["expr"]))
        for value in rule.get("annotations", {}).values():
            out += [(name, q) for q in _template_queries(value) if not q.startswith("%")]
    return out


def test_metric_name_extraction() -> None:
    expr = ('sum by (run, rank) (rate(robust_x_total{job="a"}[5m] offset 1h)) > on (run) '
            'group_left (node) run:y:z  # 30 seconds\n and up unless foo_bar == bool 1e-3')
    assert metric_names(expr) == {"robust_x_total", "run:y:z", "up", "foo_bar"}


def test_every_metric_named_in_a_rule_is_in_the_schema() -> None:
    declared = set(schema.sample_names()) | PROMETHEUS_SERIES
    records = {r["record"] for r in RECORDS}
    unknown = {}
    for name, expr in _all_expressions():
        for metric in metric_names(expr):
            if ":" in metric:
                if metric not in records:
                    unknown.setdefault(name, []).append(metric)
            elif metric not in declared:
                unknown.setdefault(name, []).append(metric)
    assert not unknown, f"names neither in robust_metrics.schema nor recorded: {unknown}"


def test_recording_rules_are_named_level_metric_operations() -> None:
    for r in RECORDS:
        if r in NODE_SUMMARY_RECORDS:  # the sidecar's own series, for runs without one
            assert r["record"] in schema.sample_names(), r["record"]
            continue
        level, metric, ops = r["record"].split(":")
        assert re.fullmatch(r"[a-z]+(?:_[a-z]+)*", level), r["record"]
        assert re.fullmatch(r"robust_[a-z0-9_]+", metric), r["record"]
        assert re.fullmatch(r"[a-z0-9_]+", ops), r["record"]
    # One name may be recorded by several rules only for distinct static labels (the verdict:
    # one rule per class); the same series from two rules would overwrite each other.
    keys = [(r["record"], tuple(sorted((r.get("labels") or {}).items()))) for r in RECORDS]
    assert len(set(keys)) == len(keys), "a recording rule twice"


def test_the_issue_alerts_all_exist() -> None:
    wanted = {"TrainingHang", "RankHang", "SlowRank", "StragglerSlowdownHigh", "LossSpike",
              "GradNormSpike", "NonFiniteLoss", "NonFiniteGradients", "ThroughputDrop",
              "GPUXidCritical", "GPUEccUncorrectable", "GPURowRemapFailure", "GPUThermalThrottle",
              "GPULost", "NICLinkDown", "NICFlapping", "SidecarDown", "CheckpointStale", "RankExited",
              "LossRise", "GradNormRise", "MFUDrop", "SuspectNode", "SkippedStepStorm",
              "NodeSelftestFailed", "NodeSummariesMissing"}
    assert {a["alert"] for a in ALERTS} == wanted


# -- series budget ----------------------------------------------------------------------------
# Per-rank records that exist only around an event (a spike, a hang, a crash, a slow rank):
# a healthy rank has none of them.
EVENT_RANK_RECORDS = {
    "run_rank:robust_loss_spikes:increase5m", "run_rank:robust_grad_norm_spikes:increase5m",
    "run_rank:robust_rank_process_stopped:hang",
    "run_rank:robust_rank_exit_timestamp_seconds:crashed",
    "run_rank:robust_rank_exit_timestamp_seconds:first_crash",
    "run_rank:robust_step_compute_seconds:slow1m",
}
# Per-rank metrics a CPU rank does not publish while healthy (CUDA memory; hook errors).
NOT_ON_A_HEALTHY_CPU_RANK = {"robust_cuda_memory_allocated_bytes",
                             "robust_cuda_memory_reserved_bytes", "robust_cuda_memory_peak_bytes",
                             "robust_hook_errors_total"}


def test_a_healthy_default_rank_costs_at_most_42_series() -> None:
    """The issue's budget (16,384 ranks under 700k series): what the hook and the sidecar publish
    per rank by default, one series per sample name and label value set, plus the per-rank
    records. A new per-rank record must be declared an event record here or fit the budget."""
    scraped = 0
    for m in schema.all_metrics():
        if (not m.default_on or m.on_event or "rank" not in m.labels
                or m.source not in (schema.Source.RANK, schema.Source.SIDECAR)
                or m.name in NOT_ON_A_HEALTHY_CPU_RANK):
            continue
        values = {"phase": len(schema.PHASES), "op": 1, "group": 1, "where": 1}
        per_labels = 1
        for label in m.labels:
            per_labels *= values.get(label, 1)
        scraped += per_labels * len(m.sample_names())
    per_rank_records = {r["record"] for r in RECORDS
                        if r["record"].split(":")[0] in ("run_rank", "run_rank_group")}
    healthy_records = {r for r in per_rank_records if r not in EVENT_RANK_RECORDS
                       and not r.startswith("run_rank_group:")}  # recorded only during a hang
    assert per_rank_records >= EVENT_RANK_RECORDS
    assert scraped + len(healthy_records) <= 42, (scraped, sorted(healthy_records))


# -- alert conventions ------------------------------------------------------------------------
@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a["alert"])
def test_alert_carries_labels_and_annotations(alert: dict[str, Any]) -> None:
    labels, notes = alert["labels"], alert["annotations"]
    assert labels["severity"] in {"critical", "warning", "info"}
    assert labels["action"] in ACTIONS
    assert "{{" not in notes["summary"] and notes["summary"].endswith(".")
    assert "{{ $labels." in notes["description"]
    level = "node" if "on (node" in alert["expr"] or "node, gpu" in alert["expr"] or \
        "by (node" in alert["expr"] or "(up == 0)" in alert["expr"] else "run"
    assert f"{{{{ $labels.{level} }}}}" in notes["description"], level
    if "rank" in alert["expr"] and "by (run, rank" in alert["expr"]:
        assert "{{ $labels.rank }}" in notes["description"]
    anchor = alert["alert"].lower()
    assert notes["runbook_url"] == f"{rules.RUNBOOK_BASE}#{anchor}"


def test_runbook_has_a_section_per_alert() -> None:
    text = (RULES / "RUNBOOK.md").read_text()
    headings = re.findall(r"^## (\w+)\s*$", text, flags=re.M)
    assert sorted(headings) == sorted(a["alert"] for a in ALERTS)
    for alert in ALERTS:
        section = text.split(f"## {alert['alert']}\n", 1)[1].split("\n## ", 1)[0]
        assert f"`{alert['labels']['action']}`" in section, alert["alert"]


def test_hang_and_slowness_alerts_are_silenced_by_the_checkpoint_and_eval_phases() -> None:
    for alert in ALERTS:
        if alert["alert"] in {"TrainingHang", "RankHang", "SlowRank", "StragglerSlowdownHigh",
                              "ThroughputDrop", "MFUDrop"}:
            # the hang alerts also wait out the first minute after a phase (`resuming`)
            assert re.search(r"unless on \(run\) (?:max_over_time\()?"
                             r"run:robust_phase:(paused|resuming)\b", alert["expr"]), alert["alert"]


# -- rendering and time scaling ---------------------------------------------------------------
def test_durations_parse_and_format() -> None:
    assert rules.parse_duration("1h30m") == 5_400_000
    assert rules.parse_duration("500ms") == 500
    assert rules.format_duration(5_400_000) == "1h30m"
    assert rules.scale_duration("5m", 1 / 15) == "20s"
    assert rules.scale_duration("1h", 1 / 15) == "4m"
    assert rules.scale_duration("10s", 1 / 15) == "667ms"
    assert rules.scale_duration("0s", 0.5) == "0s"
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        rules.parse_duration("5 minutes")


def test_scale_expr_scales_ranges_offsets_subqueries_and_marked_constants() -> None:
    expr = ("rate(x[5m]) > avg_over_time(y[1h:1m] offset 5m) and z > 60  # seconds\n"
            "and w > 60 and max_over_time(v[30m:])")
    out = rules.scale_expr(expr, 1 / 15)
    assert out == ("rate(x[20s]) > avg_over_time(y[4m:4s] offset 20s) and z > 4  # seconds\n"
                   "and w > 60 and max_over_time(v[2m:])")
    assert rules.scale_expr(expr, 1) == expr


def test_every_seconds_comment_follows_the_number_it_scales() -> None:
    """`--time-scale` scales the number right before a `# seconds` comment; one after a closing
    parenthesis would stay unscaled (a 10 s floor at 1/15 scale is 150 s at the defaults)."""
    for group in GROUPS:
        for rule in group["rules"]:
            for line in str(rule["expr"]).splitlines():
                if "# seconds" in line:
                    assert re.search(r"\d\s*# seconds", line), (rule.get("alert") or
                                                                rule.get("record"), line)


def test_time_scale_changes_for_and_windows_but_not_ratios() -> None:
    fast = {r.get("alert") or r.get("record"): r for g in rules.load_groups(time_scale=1 / 15)
            for r in g["rules"]}
    assert fast["SlowRank"]["for"] == "3s"
    assert "1.2\n" in fast["run_rank:robust_step_compute_seconds:over_ratio1m"]["expr"]
    assert "[8s]" in fast["SlowRank"]["expr"]
    assert "[4s]" in fast["run:robust_phase:resuming"]["expr"]
    assert "offset 4s" in fast["run_rank:robust_step_compute_seconds:over_ratio1m"]["expr"]
    assert "[20s]" in fast["run:robust_steps:rate5m"]["expr"]
    # the hook's windows scale with ROBUST_METRICS_TIME_SCALE; their label keeps the production
    # length, so the selectors that read them stay as written
    assert 'robust_step_compute_mean_seconds{window="1m"}' in \
        fast["run_rank:robust_step_compute_seconds:over_ratio1m"]["expr"]
    assert 'robust_node_step_duration_mean_seconds{window="5m", quantile="0.5"}' in \
        fast["run:robust_step_duration_seconds:median5m"]["expr"]
    assert "2  # seconds" in fast["run:robust_step_duration_seconds:hang_threshold"]["expr"]
    assert "for" not in fast["TrainingHang"]
    with pytest.raises(ValueError, match="positive"):
        rules.load_groups(time_scale=0)


def test_runbook_base_can_be_replaced() -> None:
    groups = rules.load_groups(runbook_base="https://wiki.example/robust")
    assert {a["annotations"]["runbook_url"].split("#")[0] for a in rules.alerts(groups)} == \
        {"https://wiki.example/robust"}


def test_prometheus_operator_object_has_the_same_groups() -> None:
    doc = yaml.safe_load(rules.render(GROUPS, "prometheus-operator", namespace="monitoring",
                                      labels={"release": "kube-prometheus"}))
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["namespace"] == "monitoring"
    assert doc["metadata"]["labels"]["release"] == "kube-prometheus"
    assert doc["spec"]["groups"] == yaml.safe_load(rules.render(GROUPS))["groups"] == GROUPS


def test_committed_prometheusrule_matches_the_generator() -> None:
    committed = (ROOT / "deploy" / "prometheusrule.yaml").read_text()
    generated = rules.render(GROUPS, "prometheus-operator",
                             header_args=" --format prometheus-operator")
    assert committed == generated, ("deploy/prometheusrule.yaml is stale: run `robust-metrics "
                                    "rules --format prometheus-operator --out "
                                    "deploy/prometheusrule.yaml`")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, "-m", "robust_metrics.cli", "rules", *args)


def test_cli_writes_plain_and_operator_output(tmp_path: Path) -> None:
    out = tmp_path / "r.yml"
    result = cli("--out", str(out), "--time-scale", "0.5")
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("# Generated by `robust-metrics rules --time-scale 0.5`")
    assert yaml.safe_load(text)["groups"] == rules.load_groups(time_scale=0.5)
    result = cli("--format", "prometheus-operator", "--label", "release=prom")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["metadata"]["labels"]["release"] == "prom"


@pytest.mark.parametrize(("args", "message"), [
    (["--format", "jsonnet"], "invalid choice"),
    (["--time-scale", "-1"], "must be positive"),
    (["--time-scale", "fast"], "not a number"),
    (["--label", "novalue"], "KEY=VALUE"),
    (["--rules-dir", "/nonexistent"], "no rule files"),
    (["--out", "/nonexistent/dir/rules.yml"], "cannot write"),
])
def test_cli_rejects_bad_input_with_a_message(args: list[str], message: str) -> None:
    result = cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_names_a_broken_rule_file(tmp_path: Path) -> None:
    (tmp_path / "bad.yml").write_text("rules: []\n")
    result = cli("--rules-dir", str(tmp_path))
    assert result.returncode == 2
    assert "bad.yml: expected a mapping with a 'groups' list" in result.stderr


def test_the_package_finds_its_rules() -> None:
    assert rules.RULES_DIR.is_dir()
    assert {p.name for p in rules.rule_files()} == {
        "training.yml", "stragglers.yml", "attribution.yml", "numerics.yml", "gpu.yml", "nic.yml",
        "exporter.yml", "mfu.yml", "nodes.yml", "badput.yml", "selftest.yml",
        "node_summaries.yml"}


# -- Alertmanager routing example -------------------------------------------------------------
def test_amtool_accepts_the_routing_example() -> None:
    amtool = require_binary("amtool")
    result = run(amtool, "check-config", str(ALERTMANAGER))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("labels", "receivers"), [
    (["action=restart", "severity=critical", "run=r"], "robust-bridge,oncall-page"),
    (["action=dump_stacks", "severity=critical", "run=r"], "robust-bridge,oncall-page"),
    (["action=drain_node", "severity=critical", "node=n0"], "robust-bridge,oncall-page"),
    (["action=checkpoint", "severity=warning", "run=r"], "robust-bridge,oncall"),
    (["action=none", "severity=warning", "run=r"], "oncall"),
    (["action=none", "severity=critical", "run=r"], "oncall-page"),
])
def test_amtool_routes_alerts_by_action(labels: list[str], receivers: str) -> None:
    amtool = require_binary("amtool")
    result = run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                 f"--verify.receivers={receivers}", *labels)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_action_reaches_a_receiver() -> None:
    amtool = require_binary("amtool")
    for alert in ALERTS:
        labels = [f"{k}={v}" for k, v in alert["labels"].items()]
        result = run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                     f"alertname={alert['alert']}", *labels)
        assert result.returncode == 0, result.stderr
        wants_bridge = alert["labels"]["action"] != "none"
        assert ("robust-bridge" in result.stdout) == wants_bridge, (alert["alert"], result.stdout)


def test_bridge_receiver_uses_bearer_auth_and_gets_resolved_alerts() -> None:
    config = yaml.safe_load(ALERTMANAGER.read_text())
    bridge = next(r for r in config["receivers"] if r["name"] == "robust-bridge")
    hook = bridge["webhook_configs"][0]
    assert hook["send_resolved"] is True
    assert hook["url"].endswith("/api/v1/alerts")
    assert hook["http_config"]["authorization"]["type"] == "Bearer"
    assert "run" in config["route"]["group_by"]
