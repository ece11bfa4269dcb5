"""Policy validation: a bad policy stops the bridge at start with a message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from robust_metrics.bridge import policy
from robust_metrics.bridge.config import ConfigError, load, parse
from robust_metrics.bridge.signing import signed_request, verify
from tests.support import ROOT


def base(**extra: Any) -> dict[str, Any]:
    return {"auth": {"bearer_token": "t"},
            "schedulers": {"local": {"type": "local", "command": ["true"]}},
            "rules": [{"name": "r", "match": {"action": "restart"}, "actions": ["restart"]}],
            **extra}


@pytest.mark.parametrize(("patch", "message"), [
    ({"auth": {}}, "auth: a bearer_token"),
    ({"auth": {"basic": {"username": "u"}}}, "auth.basic: give both"),
    ({"listen": {"port": "80"}}, "listen.port: expected an integer"),
    ({"listen": {"prot": 1}}, "listen: unknown key(s) prot"),
    ({"rules": []}, "rules: expected a non-empty list"),
    ({"rules": [{"match": {"a": "b"}, "actions": ["restrat"]}]},
     "rules[0].actions[0]: unknown action 'restrat' (choose one of checkpoint"),
    ({"rules": [{"actions": ["notify"]}]}, "rules[0]: give `match` or `match_re`"),
    ({"rules": [{"match": {"rank": 3}, "actions": ["dump_stacks"]}]},
     "rules[0].match.rank: label values are strings"),
    ({"rules": [{"match_re": {"run": "("}, "actions": ["dump_stacks"]}]},
     "rules[0].match_re.run: bad regular expression"),
    ({"rules": [{"match": {"a": "b"}, "for": "5 minutes", "actions": ["dump_stacks"]}]},
     "rules[0].for: expected a duration"),
    ({"rules": [{"match": {"a": "b"}, "actions": ["notify"]}]}, "notify.url` is not set"),
    ({"rules": [{"match": {"a": "b"}, "actions": [{"type": "restart", "scheduler": "slrum"}]}]},
     "no scheduler named 'slrum'"),
    ({"rules": [{"match": {"a": "b"}, "actions": [{"type": "checkpoint", "timeout_s": -1}]}]},
     "timeout_s: must be >= 0"),
    ({"schedulers": {"x": {"type": "pbs"}}}, "schedulers.x.type: unknown scheduler type 'pbs'"),
    ({"sidecars": {"url_template": "http://host:9400"}}, "must contain {node}"),
    ({"sidecars": {"ack_source": "prometheus"}}, "prometheus.url is not set"),
    ({"restart_budget": {"max_restarts": 1.5}}, "restart_budget.max_restarts: expected an int"),
])
def test_bad_policy_is_refused_with_a_clear_message(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(base(**patch))
    assert message in str(err.value)


def test_good_policy_and_plan(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    config = parse(base(auth={"bearer_token_file": "token"}, rules=[
        {"name": "hang", "match": {"severity": "critical"}, "match_re": {"alertname": ".*Hang"},
         "for": "1m", "cooldown_s": 60,
         "actions": ["dump_stacks", {"type": "restart", "checkpoint_first": True}]},
        {"name": "slow", "match": {"alertname": "Slow"},
         "actions": [{"type": "restart", "checkpoint_first": True, "require_checkpoint": True}]},
    ]), tmp_path)
    assert config.auth.bearer_token == "from-file"
    hang = {"alertname": "RankHang", "severity": "critical", "run": "r"}
    rule = policy.match_rule(config, hang)
    assert rule is not None and rule.name == "hang" and rule.for_s == 60
    # A hung job gets no checkpoint before its restart; a slow one does, and it is required.
    assert [s["type"] for s in policy.build_plan(config, rule, hang)] == ["dump_stacks",
                                                                          "restart"]
    slow_rule = policy.match_rule(config, {"alertname": "Slow"})
    assert slow_rule is not None
    plan = policy.build_plan(config, slow_rule, {"alertname": "Slow"})
    assert [(s["type"], s["continue_on_error"]) for s in plan] == [("checkpoint", False),
                                                                   ("restart", False)]
    assert policy.match_rule(config, {"alertname": "RankHang", "severity": "warning"}) is None
    assert policy.not_before(rule, "2026-01-01T00:00:00.123456789Z") == pytest.approx(
        1767225600.123456 + 60)


def test_example_policy_is_valid() -> None:
    out = subprocess.run([sys.executable, "-m", "robust_metrics", "bridge", "--config",
                          str(ROOT / "examples" / "bridge.yaml"), "--check"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"BRIDGE_TOKEN": "x", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "valid" in out.stdout


def test_cli_reports_bad_policy(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("auth: {bearer_token: t}\nrules: [{match: {a: b}, "
                                       "actions: [reboot]}]\n")
    out = subprocess.run([sys.executable, "-m", "robust_metrics", "bridge", "--config",
                          str(tmp_path / "bad.yaml"), "--check"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert "unknown action 'reboot'" in out.stderr
    assert load  # the same loader the CLI uses


def test_signature_round_trip_and_tamper() -> None:
    body, headers = signed_request({"operation": "restart", "run": "r"}, "secret", key="k#0")
    assert verify("secret", headers, body)
    assert not verify("other", headers, body)
    assert not verify("secret", headers, body.replace(b'"r"', b'"x"'))
    assert not verify("secret", headers, body, now=int(headers["X-Robust-Timestamp"]) + 3600)
    assert headers["Idempotency-Key"] == "k#0"
