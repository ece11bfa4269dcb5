"""Policy validation: a bad policy stops the bridge at start with a message naming the key."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from robust_metrics.bridge import policy
from robust_metrics.bridge.config import ConfigError, load, parse
from robust_metrics.bridge.declared import Duration, Refused, read, setting
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


# ----------------------------------------------------------------------------- the declared reader
def _rules(*steps: Any, **rule: Any) -> list[dict[str, Any]]:
    return [{"name": "first", "match": {"a": "b"}, "actions": ["dump_stacks"]},
            {"name": "second", "match": {"a": "c"}, "actions": list(steps) or ["dump_stacks"],
             **rule}]


@pytest.mark.parametrize(("patch", "message"), [
    ({"rules": _rules({"type": "checkpoint", "timeout": "soon"})},
     "rules[1].actions[0].timeout: expected a duration such as 30s, 5m or 1h"),
    ({"rules": _rules({"type": "checkpoint", "timout": 5})},
     "rules[1].actions[0]: unknown key(s) timout (allowed: at_step, continue_on_error, scheduler, "
     "timeout, timeout_s, type)"),
    ({"rules": _rules({"type": "checkpoint", "at_step": "3"})},
     "rules[1].actions[0].at_step: expected an integer, got '3'"),
    ({"rules": _rules({"type": "restart", "notice_timeout_s": -1})},
     "rules[1].actions[0].notice_timeout_s: must be >= 0, got -1"),
    ({"rules": _rules(**{"for": 60, "for_s": 60})}, "rules[1]: give `for` or `for_s`, not both"),
    ({"rules": _rules(cooldown="1m", cooldown_s=60)},
     "rules[1]: give `cooldown` or `cooldown_s`, not both"),
    ({"rules": _rules(cooldown="an hour")}, "rules[1].cooldown: expected a duration"),
    ({"listen": {"port": 70000}}, "listen.port: must be <= 65535, got 70000"),
    ({"listen": {"port": None}}, "listen.port: expected an integer, got None"),
    ({"workers": 0}, "workers: must be >= 1, got 0"),
    ({"incidents": {"poll_s": 0}}, "incidents.poll_s: must be longer than 0"),
    ({"incidents": {"lookback": "1h", "lookback_s": 3600}},
     "incidents: give `lookback` or `lookback_s`, not both"),
    ({"restart_budget": {"window": "-1h"}}, "restart_budget.window: expected a duration"),
    ({"sidecars": {"ack_source": "both"}},
     "sidecars.ack_source: choose one of sidecar, prometheus, not 'both'"),
    ({"sidecars": {"timeout": True}}, "sidecars.timeout: expected a duration"),
    ({"notify": {"url": "http://h", "timeout": "10 s"}}, "notify.timeout: expected a duration"),
    ({"run_label": 7}, "run_label: expected a string, got 7 (quote it in YAML)"),
])
def test_the_reader_names_the_path_of_what_it_refuses(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(base(**patch))
    assert message in str(err.value)


def test_every_duration_takes_a_prometheus_duration_or_seconds_under_either_spelling() -> None:
    """One unit convention: `5m`, `300s` and `300` are the same, and `KEY_s` is `KEY`'s alias."""
    for value in ("5m", "300s", 300, 300.0, "300000ms"):
        for suffix in ("", "_s"):
            config = parse(base(
                sidecars={f"timeout{suffix}": value, f"ack_poll{suffix}": value},
                notify={"url": "http://h", f"timeout{suffix}": value},
                restart_budget={f"window{suffix}": value},
                incidents={f"{k}{suffix}": value for k in ("lookback", "recover_timeout",
                                                             "node_window", "poll")},
                rules=[{"match": {"a": "b"}, f"for{suffix}": value, f"cooldown{suffix}": value,
                        "actions": [{"type": "checkpoint", f"timeout{suffix}": value},
                                    {"type": "selftest", f"timeout{suffix}": value},
                                    {"type": "restart", f"checkpoint_timeout{suffix}": value,
                                     f"notice_timeout{suffix}": value}]}]))
            rule, side, inc = config.rules[0], config.sidecars, config.incidents
            options = [a.options for a in rule.actions]
            seconds = {rule.for_s, rule.cooldown_s, side.timeout_s, side.ack_poll_s,
                       config.notify and config.notify.timeout_s, config.restart_window_s,
                       inc.lookback_s, inc.recover_timeout_s, inc.node_window_s, inc.poll_s,
                       options[0]["timeout_s"], options[1]["timeout_s"],
                       options[2]["checkpoint_timeout_s"], options[2]["notice_timeout_s"]}
            assert seconds == {300.0}, (value, suffix)
    assert parse(base(rules=_rules(**{"for": "1d"}))).rules[1].for_s == 86400.0


def test_null_means_not_given_except_for_values_that_must_be_given() -> None:
    config = parse(base(listen={"host": None}, notify=None, sidecars=None,
                        rules=_rules(name=None)))
    assert (config.host, config.notify, config.sidecars.configured, config.rules[1].name) == (
        "127.0.0.1", None, False, "rules[1]")
    for patch in ({"dry_run": None}, {"rules": _rules(**{"for": None})},
                  {"sidecars": {"ack_source": None}}):
        with pytest.raises(ConfigError):
            parse(base(**patch))


@dataclass(frozen=True)
class Inner:
    size: int = setting(2, minimum=1, maximum=8)
    wait_s: Duration = 1.0


@dataclass(frozen=True)
class Outer:
    """A declaration of the reader's own, apart from the policy's."""

    mode: Literal["fast", "safe"] = "safe"
    port: int = setting(80, key="listen.port")
    token: str | None = setting(None, secret=True)
    inner: Inner = setting(factory=Inner)  # noqa: RUF009
    items: tuple[Inner, ...] = ()
    given: frozenset[str] = setting(given=True)

    def __post_init__(self) -> None:
        if self.mode == "fast" and self.inner.size > 4:
            raise Refused("inner.size", "at most 4 in fast mode")


def test_the_generic_reader_on_its_own_declarations(tmp_path: Path) -> None:
    """Sections, secrets, choices, bounds, cross-field checks with their path, and `given`."""
    (tmp_path / "tok").write_text("s3cret\n")
    outer = read(Outer, {"listen": {"port": 8080}, "token_file": "tok",
                         "items": [{"wait": "2m"}, {"size": 3, "wait_s": 5}]}, "top", tmp_path)
    assert (outer.port, outer.token, outer.inner, outer.mode) == (8080, "s3cret", Inner(), "safe")
    assert [(i.size, i.wait_s) for i in outer.items] == [(2, 120.0), (3, 5.0)]
    assert outer.given == {"port", "token", "items"}
    for raw, message in [
        ({"listen": {"prot": 1}}, "top.listen: unknown key(s) prot (allowed: port)"),
        ({"lsten": {}}, "top: unknown key(s) lsten (allowed: inner, items, listen, mode, token, "
                        "token_env, token_file)"),
        ({"items": [{}, {"size": 9}]}, "top.items[1].size: must be <= 8, got 9"),
        ({"items": {"size": 1}}, "top.items: expected a list, got {'size': 1}"),
        ({"inner": {"wait": "1m", "wait_s": 60}}, "top.inner: give `wait` or `wait_s`, not both"),
        ({"mode": "fast", "inner": {"size": 5}}, "top.inner.size: at most 4 in fast mode"),
        ({"mode": "quick"}, "top.mode: choose one of fast, safe, not 'quick'"),
        ({"token": "a", "token_env": "B"}, "top: give only one of token, token_env"),
        ([1], "top: expected a mapping, got list"),
    ]:
        with pytest.raises(ConfigError) as err:
            read(Outer, raw, "top", tmp_path)
        assert str(err.value) == message
