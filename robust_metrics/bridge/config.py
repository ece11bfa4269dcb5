"""The bridge's policy file (YAML), validated once at start with errors that name the bad key.

A bridge that acts on a typo'd policy restarts the wrong job at 3 a.m., so every key is checked:
unknown keys, wrong types and unknown action or scheduler names stop the start with a message such
as ``rules[1].actions[0]: unknown action 'restrat' (choose one of checkpoint, ...)``.
See docs/bridge.md for the full reference; examples/bridge.yaml is a working example.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from robust_metrics.configuration import ConfigError, resolve_secret
from robust_metrics.sidecar.config import DEFAULT_PORT as SIDECAR_PORT

if TYPE_CHECKING:
    from robust_metrics.bridge.schedulers.base import Scheduler

__all__ = [
    "ACTIONS",
    "ActionSpec",
    "AuthConfig",
    "BridgeConfig",
    "ConfigError",
    "NotifyConfig",
    "Rule",
    "SchedulerConfig",
    "SidecarEndpoints",
    "load",
    "parse",
]

MATCH_KEYS_HINT = "alertname, severity, action, run or any other alert label"


@dataclass(frozen=True)
class AuthConfig:
    bearer_token: str | None = None
    basic_username: str | None = None
    basic_password: str | None = None
    protect_metrics: bool = False


# A node name as a URL may carry it: RFC 1123 host name labels, nothing else (no port, path,
# user info, query or fragment can ride in on a label).
HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z")
DEFAULT_SIDECAR_TEMPLATE = f"http://{{node}}:{SIDECAR_PORT}"


@dataclass(frozen=True)
class SidecarEndpoints:
    """Where the node sidecars are, and the token they take.

    A `node` label comes from the alert, and through `robust_rank_info` from the job itself: it
    names a node and never addresses one. The URL of a node is its entry in `urls`, or
    `url_template` for a node that is a strict host name *and* is in `nodes` or matches `node_re`;
    else, with `discovery_job`, the target of that Prometheus scrape job whose `node` or
    `instance` label is the name (looked up by `SidecarClient`). Any other name has no URL, so the
    bearer token goes only to configured or discovered sidecars.
    """

    url_template: str = DEFAULT_SIDECAR_TEMPLATE
    urls: Mapping[str, str] = field(default_factory=dict)
    nodes: frozenset[str] = frozenset()
    node_re: re.Pattern[str] | None = None
    discovery_job: str | None = None  # Prometheus scrape job of the sidecars
    token: str | None = None
    timeout_s: float = 5.0
    ack_source: str = "sidecar"  # or "prometheus"
    ack_poll_s: float = 1.0
    configured: bool = True  # False: the policy has no `sidecars` block (checkpoints by signal)

    def url(self, node: str) -> str | None:
        """The sidecar URL of `node`, or None when the configuration does not name that host."""
        if node in self.urls:
            return self.urls[node]
        if not HOSTNAME.match(node):
            return None
        if node in self.nodes or (self.node_re is not None and self.node_re.fullmatch(node)):
            return self.url_template.replace("{node}", node)
        return None


@dataclass(frozen=True)
class NotifyConfig:
    url: str
    secret: str | None = None
    timeout_s: float = 10.0


@dataclass(frozen=True)
class SchedulerConfig:
    """One entry of `schedulers`: its adapter type, the adapter's own keys, and the folder its
    relative paths resolve against (the policy file's)."""

    name: str
    type: str
    options: Mapping[str, Any]
    base_dir: Path = Path(".")

    def create(self) -> Scheduler:
        """The adapter as the bridge builds it: every user of the policy (the bridge, `--check`,
        `robust-metrics job`) builds it here, so all of them share its state."""
        from robust_metrics.bridge.schedulers import base

        return base.create(self.type, self.options, self.base_dir)


@dataclass(frozen=True)
class ActionSpec:
    """One step of a rule's chain; `options` holds the per-type keys (see `_ACTION_OPTIONS`)."""

    type: str
    continue_on_error: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "continue_on_error": self.continue_on_error,
                "options": dict(self.options)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ActionSpec:
        return cls(data["type"], bool(data.get("continue_on_error", False)),
                   dict(data.get("options") or {}))


@dataclass(frozen=True)
class Rule:
    """Alerts whose labels match run this ordered chain of actions (first matching rule wins)."""

    name: str
    match: Mapping[str, str]
    match_re: Mapping[str, re.Pattern[str]]
    actions: tuple[ActionSpec, ...]
    for_s: float = 0.0
    cooldown_s: float = 0.0
    scheduler: str | None = None
    dry_run: bool = False

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match.items()) and all(
            p.fullmatch(labels.get(k, "")) for k, p in self.match_re.items())


@dataclass(frozen=True)
class IncidentsConfig:
    """The incident ledger, the crash-loop guard and the suspect-node ledger (`incidents:`).

    `crash_loop_restarts`: stop restarting a run whose highest step has not advanced over this
    many restarts (0: off); `lookback_s`: how far back Prometheus is read around an incident (its
    last step before a hang, the highest step of a run); `recover_timeout_s`: an incident whose
    run shows no step this long after its action is entered as not recovered; `node_window_s`:
    the window of the per-node incident count; `node_alert`: the alert that flags a node (its own
    incidents are not counted); `over_eviction`: a hang that names several suspect ranks drains
    every node holding one; `poll_s`: how often the ledger looks for finished incidents;
    `nan_alert_re`: the alerts of non-finite values, whose restarts the ledger follows to a
    transient or persistent verdict (`bridge.numerics`).
    """

    crash_loop_restarts: int = 3
    lookback_s: float = 3600.0
    recover_timeout_s: float = 3600.0
    node_window_s: float = 7 * 86400.0
    node_alert: str = "SuspectNode"
    over_eviction: bool = False
    poll_s: float = 5.0
    nan_alert_re: re.Pattern[str] = re.compile(r"NonFinite.*")


@dataclass(frozen=True)
class BridgeConfig:
    rules: tuple[Rule, ...]
    auth: AuthConfig
    host: str = "127.0.0.1"
    port: int = 9095
    database: str = "bridge.db"
    max_body_bytes: int = 1 << 20
    max_alerts: int = 1000
    workers: int = 4
    dry_run: bool = False
    prometheus_url: str | None = None
    sidecars: SidecarEndpoints = field(default_factory=SidecarEndpoints)
    schedulers: Mapping[str, SchedulerConfig] = field(default_factory=dict)
    default_scheduler: str | None = None
    notify: NotifyConfig | None = None
    restart_budget: int = 3
    restart_window_s: float = 3600.0
    hang_alert_re: re.Pattern[str] = re.compile(r"(?i).*hang.*")
    run_label: str = "run"
    incidents: IncidentsConfig = field(default_factory=IncidentsConfig)


# ----------------------------------------------------------------------------- helpers
def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings, got {key!r}")
    return value


def _only(data: Mapping[str, Any], allowed: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} "
                          f"(allowed: {', '.join(sorted(allowed))})")


def _str(data: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str | None:
    value = data.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{where}.{key}: expected a string, got {value!r}")
    return value


def _num(data: Mapping[str, Any], key: str, where: str, default: float, *, minimum: float = 0.0,
         integer: bool = False) -> Any:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where}.{key}: expected {kind}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{where}.{key}: must be >= {minimum}, got {value}")
    return value


def _bool(data: Mapping[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


# Per action type: option -> (kind, default). `scheduler` names an entry of `schedulers`.
_ACTION_OPTIONS: dict[str, dict[str, tuple[str, Any]]] = {
    "checkpoint": {"timeout_s": ("number", 120.0), "at_step": ("int", None),
                   "scheduler": ("scheduler", None)},
    "dump_stacks": {},
    "selftest": {"scheduler": ("scheduler", None), "quick": ("bool", True),
                 "checks": ("checks", None), "drain": ("bool", True),
                 "timeout_s": ("number", 330.0), "min_fraction": ("number", 0.5)},
    "restart": {"scheduler": ("scheduler", None), "checkpoint_first": ("bool", False),
                "require_checkpoint": ("bool", False), "checkpoint_timeout_s": ("number", 120.0),
                "notice_timeout_s": ("number", 60.0)},
    "drain_node": {"scheduler": ("scheduler", None)},
    "notify": {"message": ("str", None)},
}
# The action names, declared once: the keys above (each runs through `actions.HANDLERS`).
ACTIONS: tuple[str, ...] = tuple(_ACTION_OPTIONS)


def _checks(data: Mapping[str, Any], key: str, where: str) -> str | None:
    """Self-test checks as a list or a comma-separated string, kept as the latter."""
    from robust_metrics.selftest.api import CHECKS

    value = data.get(key)
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(
            isinstance(n, str) and n.strip() in CHECKS for n in names):
        raise ConfigError(f"{where}.{key}: a list of self-test checks ({', '.join(CHECKS)}), "
                          f"got {value!r}")
    return ",".join(n.strip() for n in names)


def _action(raw: Any, where: str, schedulers: Mapping[str, SchedulerConfig]) -> ActionSpec:
    if isinstance(raw, str):
        raw = {"type": raw}
    data = _mapping(raw, where)
    kind = data.get("type")
    if kind not in ACTIONS:
        raise ConfigError(f"{where}: unknown action {kind!r} (choose one of {', '.join(ACTIONS)})")
    options_spec = _ACTION_OPTIONS[kind]
    _only(data, {"type", "continue_on_error", *options_spec}, where)
    options: dict[str, Any] = {}
    for key, (what, default) in options_spec.items():
        if what == "number":
            options[key] = float(_num(data, key, where, default))
        elif what == "int":
            value = data.get(key, default)
            if value is not None:
                value = _num(data, key, where, 0, integer=True)
            options[key] = value
        elif what == "bool":
            options[key] = _bool(data, key, where, default)
        elif what == "str":
            options[key] = _str(data, key, where, default)
        elif what == "checks":
            options[key] = _checks(data, key, where)
        elif what == "scheduler":
            name = _str(data, key, where, default)
            if name is not None and name not in schedulers:
                raise ConfigError(f"{where}.{key}: no scheduler named {name!r} in `schedulers` "
                                  f"(defined: {', '.join(sorted(schedulers)) or 'none'})")
            options[key] = name
    return ActionSpec(kind, _bool(data, "continue_on_error", where), options)


def _rule(raw: Any, where: str, schedulers: Mapping[str, SchedulerConfig],
          default_scheduler: str | None) -> Rule:
    data = _mapping(raw, where)
    _only(data, {"name", "match", "match_re", "actions", "for", "for_s", "cooldown_s",
                 "scheduler", "dry_run"}, where)
    name = _str(data, "name", where) or where
    match = _mapping(data.get("match"), f"{where}.match")
    for key, value in match.items():
        if not isinstance(value, str):
            raise ConfigError(f"{where}.match.{key}: label values are strings, got {value!r} "
                              "(quote it in YAML)")
    match_re: dict[str, re.Pattern[str]] = {}
    for key, value in _mapping(data.get("match_re"), f"{where}.match_re").items():
        if not isinstance(value, str):
            raise ConfigError(f"{where}.match_re.{key}: expected a regular expression string")
        try:
            match_re[key] = re.compile(value)
        except re.error as exc:
            raise ConfigError(f"{where}.match_re.{key}: bad regular expression: {exc}") from None
    if not match and not match_re:
        raise ConfigError(f"{where}: give `match` or `match_re` on {MATCH_KEYS_HINT} "
                          "(a rule that matches everything is almost never meant)")
    actions_raw = data.get("actions")
    if not isinstance(actions_raw, list) or not actions_raw:
        raise ConfigError(f"{where}.actions: expected a non-empty list of actions "
                          f"({', '.join(ACTIONS)})")
    actions = tuple(_action(a, f"{where}.actions[{i}]", schedulers)
                    for i, a in enumerate(actions_raw))
    scheduler = _str(data, "scheduler", where, default_scheduler)
    if scheduler is not None and scheduler not in schedulers:
        raise ConfigError(f"{where}.scheduler: no scheduler named {scheduler!r} in `schedulers`")
    needs_scheduler = [a.type for a in actions
                       if (a.type in ("restart", "drain_node")
                           or (a.type == "selftest" and a.options.get("drain")))
                       and not a.options.get("scheduler")]
    if needs_scheduler and scheduler is None:
        raise ConfigError(f"{where}: action {needs_scheduler[0]} needs a scheduler: define "
                          "`schedulers` and set `scheduler` on the rule or the action")
    if "for" in data and "for_s" in data:
        raise ConfigError(f"{where}: give `for` or `for_s`, not both")
    for_s = _duration(data["for"], f"{where}.for") if "for" in data else float(
        _num(data, "for_s", where, 0.0))
    return Rule(name, dict(match), match_re, actions, for_s,
                float(_num(data, "cooldown_s", where, 0.0)), scheduler,
                _bool(data, "dry_run", where))


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")


def _duration(value: Any, where: str) -> float:
    """Prometheus-style durations (`30s`, `5m`, `1h`) or plain seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    m = _DURATION.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(f"{where}: expected a duration such as 30s, 5m or 1h, got {value!r}")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _incidents(raw: Any) -> IncidentsConfig:
    data = _mapping(raw, "incidents")
    _only(data, {"crash_loop_restarts", "lookback", "recover_timeout", "node_window",
                 "node_alert", "over_eviction", "poll", "nan_alert_re"}, "incidents")
    d = IncidentsConfig()
    nan_re = _str(data, "nan_alert_re", "incidents", d.nan_alert_re.pattern) or ""
    try:
        nan_pattern = re.compile(nan_re)
    except re.error as exc:
        raise ConfigError(f"incidents.nan_alert_re: bad regular expression: {exc}") from None
    out = IncidentsConfig(
        crash_loop_restarts=int(_num(data, "crash_loop_restarts", "incidents",
                                     d.crash_loop_restarts, integer=True)),
        lookback_s=_duration(data.get("lookback", d.lookback_s), "incidents.lookback"),
        recover_timeout_s=_duration(data.get("recover_timeout", d.recover_timeout_s),
                                    "incidents.recover_timeout"),
        node_window_s=_duration(data.get("node_window", d.node_window_s),
                                "incidents.node_window"),
        node_alert=_str(data, "node_alert", "incidents", d.node_alert) or d.node_alert,
        over_eviction=_bool(data, "over_eviction", "incidents"),
        poll_s=_duration(data.get("poll", d.poll_s), "incidents.poll"),
        nan_alert_re=nan_pattern,
    )
    for name in ("lookback_s", "node_window_s", "poll_s"):
        if getattr(out, name) <= 0:
            raise ConfigError(f"incidents.{name[:-2]}: must be longer than 0")
    return out


def _schedulers(raw: Any, base: Path) -> dict[str, SchedulerConfig]:
    from robust_metrics.bridge.schedulers import base as sched_base

    out: dict[str, SchedulerConfig] = {}
    for name, body in _mapping(raw, "schedulers").items():
        where = f"schedulers.{name}"
        data = dict(_mapping(body, where))
        kind = data.pop("type", None)
        if kind not in sched_base.names():
            raise ConfigError(f"{where}.type: unknown scheduler type {kind!r} "
                              f"(choose one of {', '.join(sched_base.names())})")
        out[name] = SchedulerConfig(name, kind, data, base)
    return out


def _sidecars(side: Mapping[str, Any], base: Path, prometheus_url: str | None,
              configured: bool) -> SidecarEndpoints:
    _only(side, {"url_template", "urls", "nodes", "node_re", "discovery_job", "token",
                 "token_file", "token_env", "timeout_s", "ack_source", "ack_poll_s"}, "sidecars")
    urls = _mapping(side.get("urls"), "sidecars.urls")
    for node, url in urls.items():
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"sidecars.urls.{node}: expected an http(s) URL, got {url!r}")
    template = _str(side, "url_template", "sidecars", DEFAULT_SIDECAR_TEMPLATE) or ""
    if "{node}" not in template or not template.startswith(("http://", "https://")):
        raise ConfigError("sidecars.url_template: must contain {node} and be an http(s) URL, "
                          f"e.g. {DEFAULT_SIDECAR_TEMPLATE}")
    nodes_raw = side.get("nodes") or []
    if not isinstance(nodes_raw, list) or not all(
            isinstance(n, str) and HOSTNAME.match(n) for n in nodes_raw):
        raise ConfigError(f"sidecars.nodes: expected a list of host names, got {nodes_raw!r}")
    node_re = None
    if side.get("node_re") is not None:
        pattern = _str(side, "node_re", "sidecars") or ""
        try:
            node_re = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"sidecars.node_re: bad regular expression: {exc}") from None
    if "url_template" in side and not nodes_raw and node_re is None:
        raise ConfigError("sidecars.url_template: name the hosts it may address in "
                          "sidecars.nodes or sidecars.node_re (alert labels come from jobs; the "
                          "sidecar token goes only to configured hosts)")
    discovery_job = _str(side, "discovery_job", "sidecars")
    if discovery_job is not None and not prometheus_url:
        raise ConfigError("sidecars.discovery_job: needs prometheus.url (the sidecars are that "
                          "Prometheus's scrape targets)")
    ack_source = _str(side, "ack_source", "sidecars", "sidecar")
    if ack_source not in ("sidecar", "prometheus"):
        raise ConfigError(f"sidecars.ack_source: choose sidecar or prometheus, not {ack_source!r}")
    if ack_source == "prometheus" and not prometheus_url:
        raise ConfigError("sidecars.ack_source is prometheus but prometheus.url is not set")
    return SidecarEndpoints(
        url_template=template, urls=dict(urls), nodes=frozenset(nodes_raw), node_re=node_re,
        discovery_job=discovery_job,
        token=resolve_secret(side, "token", "sidecars", base),
        timeout_s=float(_num(side, "timeout_s", "sidecars", 5.0)), ack_source=ack_source,
        ack_poll_s=float(_num(side, "ack_poll_s", "sidecars", 1.0)),
        configured=configured,
    )


# ----------------------------------------------------------------------------- entry points
_TOP = {"listen", "database", "max_body_bytes", "max_alerts", "workers", "dry_run", "auth",
        "prometheus", "sidecars", "schedulers", "default_scheduler", "notify", "restart_budget",
        "hang_alert_re", "run_label", "rules", "incidents"}


def parse(raw: Any, base_dir: str | Path = ".") -> BridgeConfig:
    """Validate an already-loaded YAML document; relative paths resolve against `base_dir`."""
    base = Path(base_dir)
    data = _mapping(raw, "config")
    _only(data, _TOP, "config")

    listen = _mapping(data.get("listen"), "listen")
    _only(listen, {"host", "port"}, "listen")
    host = _str(listen, "host", "listen", "127.0.0.1") or "127.0.0.1"
    port = int(_num(listen, "port", "listen", 9095, integer=True))
    if port > 65535:
        raise ConfigError(f"listen.port: {port} is not a TCP port")

    auth_raw = _mapping(data.get("auth"), "auth")
    _only(auth_raw, {"bearer_token", "bearer_token_file", "bearer_token_env", "basic",
                     "protect_metrics"}, "auth")
    basic = _mapping(auth_raw.get("basic"), "auth.basic")
    _only(basic, {"username", "password", "password_file", "password_env"}, "auth.basic")
    auth = AuthConfig(
        bearer_token=resolve_secret(auth_raw, "bearer_token", "auth", base),
        basic_username=_str(basic, "username", "auth.basic"),
        basic_password=resolve_secret(basic, "password", "auth.basic", base),
        protect_metrics=_bool(auth_raw, "protect_metrics", "auth"),
    )
    if bool(auth.basic_username) != bool(auth.basic_password):
        raise ConfigError("auth.basic: give both username and password")
    if not auth.bearer_token and not auth.basic_username:
        raise ConfigError("auth: a bearer_token (or bearer_token_file/_env) or basic username and "
                          "password is required; the bridge can restart jobs and never runs open")

    prom = _mapping(data.get("prometheus"), "prometheus")
    _only(prom, {"url"}, "prometheus")

    prometheus_url = _str(prom, "url", "prometheus")
    sidecars = _sidecars(_mapping(data.get("sidecars"), "sidecars"), base, prometheus_url,
                         configured=data.get("sidecars") is not None)


    schedulers = _schedulers(data.get("schedulers"), base)
    default_scheduler = _str(data, "default_scheduler", "config")
    if default_scheduler is None and len(schedulers) == 1:
        default_scheduler = next(iter(schedulers))
    if default_scheduler is not None and default_scheduler not in schedulers:
        raise ConfigError(f"default_scheduler: no scheduler named {default_scheduler!r}")

    notify = None
    if data.get("notify") is not None:
        n = _mapping(data["notify"], "notify")
        _only(n, {"url", "secret", "secret_file", "secret_env", "timeout_s"}, "notify")
        url = _str(n, "url", "notify")
        if not url or not url.startswith(("http://", "https://")):
            raise ConfigError(f"notify.url: expected an http(s) URL, got {url!r}")
        notify = NotifyConfig(url, resolve_secret(n, "secret", "notify", base),
                              float(_num(n, "timeout_s", "notify", 10.0)))

    budget = _mapping(data.get("restart_budget"), "restart_budget")
    _only(budget, {"max_restarts", "window"}, "restart_budget")

    rules_raw = data.get("rules")
    if not isinstance(rules_raw, list) or not rules_raw:
        raise ConfigError("rules: expected a non-empty list of rules (match -> actions)")
    rules = tuple(_rule(r, f"rules[{i}]", schedulers, default_scheduler)
                  for i, r in enumerate(rules_raw))
    if notify is None:
        for rule in rules:
            if any(a.type == "notify" for a in rule.actions):
                raise ConfigError(f"rule {rule.name!r} uses notify but `notify.url` is not set")
    names = [r.name for r in rules]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"rules: names must be unique (repeated: {', '.join(dupes)})")

    hang_re = _str(data, "hang_alert_re", "config", r"(?i).*hang.*") or ""
    try:
        hang_pattern = re.compile(hang_re)
    except re.error as exc:
        raise ConfigError(f"hang_alert_re: bad regular expression: {exc}") from None

    database = _str(data, "database", "config", "bridge.db") or "bridge.db"
    if database != ":memory:":
        database = str((base / database).expanduser())
    return BridgeConfig(
        rules=rules, auth=auth, host=host, port=port, database=database,
        max_body_bytes=int(_num(data, "max_body_bytes", "config", 1 << 20, minimum=1024,
                                integer=True)),
        max_alerts=int(_num(data, "max_alerts", "config", 1000, minimum=1, integer=True)),
        workers=int(_num(data, "workers", "config", 4, minimum=1, integer=True)),
        dry_run=_bool(data, "dry_run", "config"),
        prometheus_url=prometheus_url, sidecars=sidecars, schedulers=schedulers,
        default_scheduler=default_scheduler, notify=notify,
        restart_budget=int(_num(budget, "max_restarts", "restart_budget", 3, integer=True)),
        restart_window_s=_duration(budget.get("window", 3600), "restart_budget.window"),
        hang_alert_re=hang_pattern,
        run_label=_str(data, "run_label", "config", "run") or "run",
        incidents=_incidents(data.get("incidents")),
    )


def load(path: str | Path) -> BridgeConfig:
    """Read and validate the policy file at `path`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read policy file {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return parse(raw, path.parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
