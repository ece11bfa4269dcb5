"""The generated dashboards: committed JSON is current, names exist, layout and SDK models hold."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from robust_metrics import dashboards, schema
from robust_metrics.cli import main as cli_main
from tests.support import ROOT, require_binary

pytest.importorskip("grafana_foundation_sdk")

COMMITTED = ROOT / "dashboards"
# uids are what links, bookmarks and provisioning point at: changing one breaks users' URLs.
STABLE_UIDS = {
    "training-overview.json": "robust-training-overview",
    "stragglers.json": "robust-stragglers",
    "node-gpu-health.json": "robust-node-gpu-health",
    "actions.json": "robust-actions",
}
SAMPLE_VALUES = {"run": "(run-a|run-b)", "node": ".*", "rank": "(0|1)", "datasource": "prom",
                 "__rate_interval": "1m", "__interval": "15s", "__range": "1h"}

PROMQL_FUNCTIONS = {
    "abs", "absent", "avg_over_time", "ceil", "changes", "clamp_max", "clamp_min", "count_over_time",
    "delta", "deriv", "exp", "floor", "histogram_quantile", "idelta", "increase", "irate",
    "label_replace", "ln", "log10", "log2", "max_over_time", "min_over_time", "predict_linear",
    "quantile_over_time", "rate", "resets", "round", "scalar", "sort", "sort_desc", "sqrt",
    "stddev_over_time", "sum_over_time", "time", "timestamp", "vector", "last_over_time",
    "label_values", "clamp", "present_over_time",
}
PROMQL_KEYWORDS = {
    "sum", "min", "max", "avg", "count", "quantile", "topk", "bottomk", "stddev", "stdvar",
    "group", "count_values", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "inf", "nan",
}
LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
MATCHERS = re.compile(r"\{[^}]*\}")
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
RANGES = re.compile(r"\[[^\]]*\]")
IDENT = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)")


LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")


def variable_selector(query: str) -> tuple[str, str]:
    """`label_values(SELECTOR, LABEL)` (a Grafana variable query) into (SELECTOR, LABEL)."""
    match = LABEL_VALUES.match(query)
    assert match, f"not a label_values() query: {query}"
    return match.group(1), match.group(2)


def metric_names(expr: str) -> set[str]:
    """Series names (metrics and recording rules) a PromQL expression selects."""
    if expr.startswith("label_values("):
        expr = variable_selector(expr)[0]
    text = STRINGS.sub('""', expr)
    text = MATCHERS.sub("", text)
    text = LABEL_LISTS.sub(" ", text)
    text = RANGES.sub("", text)
    names = set()
    for m in IDENT.finditer(text):
        word = m.group(1)
        if word.lower() in PROMQL_KEYWORDS or word in PROMQL_FUNCTIONS:
            continue
        names.add(word)
    return names


def all_exprs() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for panel queries, annotations and variables."""
    out = [(s.uid, p.title, t.expr) for s, p, t in dashboards.iter_targets()]
    for spec in dashboards.DASHBOARDS:
        out += [(spec.uid, f"annotation {name}", expr) for name, _, expr in spec.annotations]
        out += [(spec.uid, f"variable {name}", q) for name, q in
                dashboards.variable_queries(spec).items()]
    return out


def recording_rules() -> set[str]:
    from robust_metrics import rules

    return {r["record"] for r in rules.recording_rules(rules.load_groups())}


def test_metric_name_extraction_sees_through_promql() -> None:
    expr = ('sum by (run, op) (rate(robust_collective_duration_seconds_sum{run=~"$run", op="x"}[1m]))'
            ' / ignoring(op) group_left level:some_metric:rate1m * on(run, rank) '
            'group_left(node) topk by (run, rank) (1, robust_rank_info{node=~"$node"}) > bool 0')
    assert metric_names(expr) == {"robust_collective_duration_seconds_sum",
                                  "level:some_metric:rate1m", "robust_rank_info"}
    assert metric_names('label_values(robust_rank_info{run=~"$run"}, node)') == {"robust_rank_info"}


def test_committed_json_matches_the_generator() -> None:
    """CI's guard: the JSON in dashboards/ is exactly what the generator writes."""
    assert cli_main(["dashboards", "--out", str(COMMITTED), "--check"]) == 0


def test_check_fails_on_stale_or_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["dashboards", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(STABLE_UIDS)
    assert cli_main(["dashboards", "--out", str(tmp_path), "--check"]) == 0
    target = tmp_path / "stragglers.json"
    target.write_text(target.read_text().replace("Stragglers", "Stragglerz"))
    (tmp_path / "actions.json").unlink()
    assert cli_main(["dashboards", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "stragglers.json" in err and "actions.json" in err
    assert "training-overview.json" not in err


def test_out_that_is_a_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert cli_main(["dashboards", "--out", str(not_a_dir)]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_generation_is_deterministic() -> None:
    assert dashboards.render_all() == dashboards.render_all()


@pytest.mark.parametrize("name", sorted(STABLE_UIDS))
def test_json_loads_back_into_the_sdk_models(name: str) -> None:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    data = json.loads((COMMITTED / name).read_text())
    model = Dashboard.from_json(data)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == data
    assert model.uid == STABLE_UIDS[name]
    assert model.panels, name


def test_uids_are_stable_and_unique() -> None:
    assert {s.file: s.uid for s in dashboards.DASHBOARDS} == STABLE_UIDS
    for name, uid in STABLE_UIDS.items():
        assert json.loads((COMMITTED / name).read_text())["uid"] == uid
    titles = [s.title for s in dashboards.DASHBOARDS]
    assert len(set(titles)) == len(titles)


@pytest.mark.parametrize("name", sorted(STABLE_UIDS))
def test_no_panel_overlaps_another(name: str) -> None:
    panels = json.loads((COMMITTED / name).read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    boxes = [(p["title"], p["gridPos"]) for p in panels]
    for title, g in boxes:
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] > 0 and g["h"] > 0, title
        assert g["x"] + g["w"] <= 24, f"{title} runs off the 24-column grid"
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                     or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
            assert apart, f"{ta!r} {a} overlaps {tb!r} {b}"


def test_overlap_check_would_catch_an_overlap() -> None:
    """The layout code wraps rows itself; a panel wider than the grid is refused."""
    bad = dashboards.DashboardSpec(
        "x", "x.json", "x", "x",
        (dashboards.Section("s", (dashboards.PanelSpec("p", "stat", (), "d", width=25),)),))
    with pytest.raises(ValueError, match="width 25"):
        dashboards.build(bad)


def test_every_metric_named_is_in_the_schema_or_a_recording_rule() -> None:
    samples = set(schema.sample_names())
    unknown = {}
    for uid, title, expr in all_exprs():
        for name in metric_names(expr):
            if ":" in name:
                continue  # recording rules: checked below
            if name not in samples and name != "ALERTS":
                unknown[f"{uid} / {title}"] = name
    assert not unknown, f"names not declared in robust_metrics.schema: {unknown}"


def test_every_recording_rule_used_exists_in_alert_rules() -> None:
    rules = recording_rules()
    used = {(uid, title, name) for uid, title, expr in all_exprs() for name in metric_names(expr)
            if ":" in name}
    missing = sorted(f"{uid} / {title}: {name}" for uid, title, name in used if name not in rules)
    assert not missing, f"recording rules not defined in alert_rules/*.yml: {missing}"


def test_variables_and_datasource() -> None:
    for spec in dashboards.DASHBOARDS:
        data = json.loads((COMMITTED / spec.file).read_text())
        variables = {v["name"]: v for v in data["templating"]["list"]}
        assert list(variables) == ["datasource", "run", "node", "rank"], spec.file
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for name in ("run", "node", "rank"):
            v = variables[name]
            assert v["type"] == "query" and v["multi"] and v["includeAll"], (spec.file, name)
            assert v["datasource"]["uid"] == "${datasource}"
        # each variable narrows the next one
        assert '$run' in variables["node"]["query"] and "$node" in variables["rank"]["query"]
        for panel in data["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
        annotations = data["annotations"]["list"]
        assert any("ALERTS" in a["expr"] for a in annotations), "alert annotations missing"


def test_per_rank_queries_honour_the_filters() -> None:
    """A panel that draws per-rank series filters by $run; all panels filter by some variable."""
    for spec, panel, target in dashboards.iter_targets():
        uses = set(re.findall(r"\$(\w+)", target.expr))
        if "robust_sidecar_collector_success" in target.expr or "bridge_action_duration" in target.expr \
                or "webhook_requests" in target.expr or "robust_bridge_incident" in target.expr:
            continue  # sidecar and bridge self-metrics (the ledger's by alert) carry neither
        assert uses & {"run", "node"}, f"{spec.uid} / {panel.title}: no $run or $node filter"


def test_expand_replaces_every_variable_and_refuses_unknown_ones() -> None:
    assert dashboards.expand('x{run=~"$run"}[${__rate_interval}]', SAMPLE_VALUES) == \
        'x{run=~"(run-a|run-b)"}[1m]'
    with pytest.raises(KeyError, match=r"\$rnu"):
        dashboards.expand('x{run=~"$rnu"}', SAMPLE_VALUES)


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    """promtool parses each expanded query (as a recording rule), so a typo fails here, not in Grafana."""
    promtool = require_binary("promtool")
    exprs = [variable_selector(e)[0] if e.startswith("label_values(") else e for _, _, e in all_exprs()]
    rules = [{"record": f"dashboard:query:n{i}", "expr": dashboards.expand(expr, SAMPLE_VALUES)}
             for i, expr in enumerate(exprs)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def test_fault_only_panels_are_declared() -> None:
    """Panels that show only faults say so, so the e2e test knows which ones need a fault."""
    needs = {p.title: p.needs for s in dashboards.DASHBOARDS for p in s.panels_flat}
    assert needs["Non-finite steps"] is dashboards.Needs.NONFINITE
    assert needs["XID events"] is dashboards.Needs.GPU_FAULT
    assert needs["Active alerts"] is dashboards.Needs.ALERT
    assert needs["Loss"] is dashboards.Needs.TRAINING


def test_docs_name_every_dashboard_and_panel() -> None:
    docs = " ".join((ROOT / "docs" / "dashboards.md").read_text().split())  # unwrap lines
    for spec in dashboards.DASHBOARDS:
        assert spec.file in docs and spec.uid in docs, spec.file
        for panel in spec.panels_flat:
            assert panel.title in docs, f"docs/dashboards.md does not mention panel {panel.title!r}"


def test_provisioning_example_is_a_file_provider() -> None:
    doc = yaml.safe_load((COMMITTED / "provisioning.yaml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
