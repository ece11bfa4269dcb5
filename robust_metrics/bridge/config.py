"""The bridge's policy file (YAML), declared as dataclasses and checked once at start.

A bridge that acts on a typo'd policy restarts the wrong job at 3 a.m., so every key is checked:
unknown keys, wrong types, values out of range and unknown action or scheduler names stop the start
with a message that names the path, such as ``rules[1].actions[0]: unknown action 'restrat'
(choose one of checkpoint, ...)``. Each key's type, default, bounds and unit are its field's
declaration below; `declared.read` walks the file against them (durations: `30s`, `5m` or plain
seconds, every one of them; `for_s`, `timeout_s`, ... are aliases of `for`, `timeout`, ...), and
what involves several keys is checked in `__post_init__`. See docs/bridge.md for the reference;
examples/bridge.yaml is a working example.
"""

# `declared.setting` returns a `dataclasses.field`, which RUF009 does not know:
# ruff: noqa: RUF009
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from robust_metrics.bridge.declared import Duration, HttpUrl, Refused, Where, mapping, read, setting
from robust_metrics.configuration import ConfigError
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
    """`auth`: what Alertmanager must send. The bridge can restart jobs, so it never runs open."""

    bearer_token: str | None = setting(None, secret=True)
    basic_username: str | None = setting(None, key="basic.username")
    basic_password: str | None = setting(None, key="basic.password", secret=True)
    protect_metrics: bool = False

    def __post_init__(self) -> None:
        if bool(self.basic_username) != bool(self.basic_password):
            raise Refused("basic", "give both username and password")
        if not self.bearer_token and not self.basic_username:
            raise Refused("", "a bearer_token (or bearer_token_file/_env) or basic username and "
                              "password is required; the bridge can restart jobs and never runs open")


# A node name as a URL may carry it: RFC 1123 host name labels, nothing else (no port, path,
# user info, query or fragment can ride in on a label).
HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z")
DEFAULT_SIDECAR_TEMPLATE = f"http://{{node}}:{SIDECAR_PORT}"


def _hostnames(value: Any, where: Where) -> frozenset[str]:
    names = [] if value is None else value
    if not isinstance(names, list | frozenset) or not all(
            isinstance(n, str) and HOSTNAME.match(n) for n in names):
        raise ConfigError(f"{where.path}: expected a list of host names, got {value!r}")
    return frozenset(names)


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
    urls: Mapping[str, HttpUrl] = setting(factory=dict)
    nodes: frozenset[str] = setting(frozenset(), parse=_hostnames)
    node_re: re.Pattern[str] | None = None
    discovery_job: str | None = None  # Prometheus scrape job of the sidecars
    token: str | None = setting(None, secret=True)
    timeout_s: Duration = 5.0
    ack_source: Literal["sidecar", "prometheus"] = "sidecar"
    ack_poll_s: Duration = 1.0
    configured: bool = setting(True, internal=True)  # False: no `sidecars` block (signals)
    given: frozenset[str] = setting(given=True)

    def __post_init__(self) -> None:
        template = self.url_template
        if "{node}" not in template or not template.startswith(("http://", "https://")):
            raise Refused("url_template", "must contain {node} and be an http(s) URL, "
                                          f"e.g. {DEFAULT_SIDECAR_TEMPLATE}")
        if "url_template" in self.given and not self.nodes and self.node_re is None:
            raise Refused("url_template", "name the hosts it may address in sidecars.nodes or "
                                          "sidecars.node_re (alert labels come from jobs; the "
                                          "sidecar token goes only to configured hosts)")

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
    """`notify`: where `notify` actions and restart-budget escalations POST, signed."""

    url: HttpUrl
    secret: str | None = setting(None, secret=True)
    timeout_s: Duration = 10.0


@dataclass(frozen=True)
class SchedulerConfig:
    """One entry of `schedulers`: its adapter type, the adapter's own keys (checked by the
    adapter, see `create`), and the folder its relative paths resolve against (the policy
    file's)."""

    name: str
    type: str
    options: Mapping[str, Any]
    base_dir: Path = Path(".")

    @classmethod
    def from_yaml(cls, raw: Any, where: Where) -> SchedulerConfig:
        from robust_metrics.bridge.schedulers import base as sched_base

        data = dict(mapping(raw, where.path))
        kind = data.pop("type", None)
        if kind not in sched_base.names():
            raise ConfigError(f"{where.path}.type: unknown scheduler type {kind!r} "
                              f"(choose one of {', '.join(sched_base.names())})")
        return cls(where.key, kind, data, where.base)

    def create(self) -> Scheduler:
        """The adapter as the bridge builds it: every user of the policy (the bridge, `--check`,
        `robust-metrics job`) builds it here, so all of them share its state."""
        from robust_metrics.bridge.schedulers import base

        return base.create(self.type, self.options, self.base_dir)


# ----------------------------------------------------------------------------- actions
def _checks(value: Any, where: Where) -> str | None:
    """Self-test checks as a list or a comma-separated string, kept as the latter."""
    from robust_metrics.selftest.api import CHECKS

    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(
            isinstance(n, str) and n.strip() in CHECKS for n in names):
        raise ConfigError(f"{where.path}: a list of self-test checks ({', '.join(CHECKS)}), "
                          f"got {value!r}")
    return ",".join(n.strip() for n in names)


@dataclass(frozen=True)
class _Step:
    """Every action takes `continue_on_error`; the subclasses declare each type's options."""

    continue_on_error: bool = False


@dataclass(frozen=True)
class _Scheduled(_Step):
    """An action that may name its own entry of `schedulers` (else the rule's)."""

    scheduler: str | None = None


@dataclass(frozen=True)
class CheckpointOptions(_Scheduled):
    timeout_s: Duration = 120.0
    at_step: int | None = None


@dataclass(frozen=True)
class DumpStacksOptions(_Step):
    pass


@dataclass(frozen=True)
class SelftestOptions(_Scheduled):
    quick: bool = True
    checks: str | None = setting(None, parse=_checks)
    drain: bool = True
    timeout_s: Duration = 330.0
    min_fraction: float = 0.5


@dataclass(frozen=True)
class RestartOptions(_Scheduled):
    checkpoint_first: bool = False
    require_checkpoint: bool = False
    checkpoint_timeout_s: Duration = 120.0
    notice_timeout_s: Duration = 60.0


@dataclass(frozen=True)
class DrainNodeOptions(_Scheduled):
    pass


@dataclass(frozen=True)
class NotifyOptions(_Step):
    message: str | None = None


ACTION_OPTIONS: dict[str, type[_Step]] = {
    "checkpoint": CheckpointOptions, "dump_stacks": DumpStacksOptions,
    "selftest": SelftestOptions, "restart": RestartOptions, "drain_node": DrainNodeOptions,
    "notify": NotifyOptions,
}
# The action names, declared once: the keys above (each runs through `actions.HANDLERS`).
ACTIONS: tuple[str, ...] = tuple(ACTION_OPTIONS)


@dataclass(frozen=True)
class ActionSpec:
    """One step of a rule's chain: a bare action name, or a mapping with `type` and that type's
    options (`ACTION_OPTIONS`), which `options` holds by their field names."""

    type: str
    continue_on_error: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, raw: Any, where: Where) -> ActionSpec:
        data = mapping({"type": raw} if isinstance(raw, str) else raw, where.path)
        kind = data.get("type")
        if kind not in ACTIONS:
            raise ConfigError(f"{where.path}: unknown action {kind!r} "
                              f"(choose one of {', '.join(ACTIONS)})")
        step = read(ACTION_OPTIONS[kind], {k: v for k, v in data.items() if k != "type"},
                    where.path, where.base, also=("type",))
        options = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        return cls(kind, options.pop("continue_on_error"), options)


# ----------------------------------------------------------------------------- rules
@dataclass(frozen=True, kw_only=True)
class Rule:
    """Alerts whose labels match run this ordered chain of actions (first matching rule wins).
    `name` defaults to the rule's place (`rules[2]`) and `scheduler` to `default_scheduler`
    (`BridgeConfig` fills both in)."""

    name: str = ""
    match: Mapping[str, str] = setting(factory=dict, expect="label values are strings")
    match_re: Mapping[str, re.Pattern[str]] = setting(factory=dict)
    actions: tuple[ActionSpec, ...] = setting(nonempty=f"actions ({', '.join(ACTIONS)})")
    for_s: Duration = 0.0
    cooldown_s: Duration = 0.0
    scheduler: str | None = None
    dry_run: bool = False

    def __post_init__(self) -> None:
        if not self.match and not self.match_re:
            raise Refused("", f"give `match` or `match_re` on {MATCH_KEYS_HINT} "
                              "(a rule that matches everything is almost never meant)")

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match.items()) and all(
            p.fullmatch(labels.get(k, "")) for k, p in self.match_re.items())


@dataclass(frozen=True)
class IncidentsConfig:
    """The incident ledger, the crash-loop guard and the suspect-node ledger (`incidents:`).

    `crash_loop_restarts`: stop restarting a run whose highest step has not advanced over this
    many restarts (0: off); `lookback`: how far back Prometheus is read around an incident (its
    last step before a hang, the highest step of a run); `recover_timeout`: an incident whose
    run shows no step this long after its action is entered as not recovered; `node_window`:
    the window of the per-node incident count; `node_alert`: the alert that flags a node (its own
    incidents are not counted); `over_eviction`: a hang that names several suspect ranks drains
    every node holding one; `poll`: how often the ledger looks for finished incidents;
    `nan_alert_re`: the alerts of non-finite values, whose restarts the ledger follows to a
    transient or persistent verdict (`bridge.numerics`).
    """

    crash_loop_restarts: int = 3
    lookback_s: Duration = setting(3600.0, above=0)
    recover_timeout_s: Duration = 3600.0
    node_window_s: Duration = setting(7 * 86400.0, above=0)
    node_alert: str = "SuspectNode"
    over_eviction: bool = False
    poll_s: Duration = setting(5.0, above=0)
    nan_alert_re: re.Pattern[str] = re.compile(r"NonFinite.*")


def _database(value: Any, where: Where) -> str:
    """The SQLite file, relative to the policy file's folder (`:memory:` stays itself)."""
    if not isinstance(value, str):
        raise ConfigError(f"{where.path}: expected a string, got {value!r}")
    return value if value == ":memory:" else str((where.base / value).expanduser())


@dataclass(frozen=True)
class BridgeConfig:
    """The whole policy. `__post_init__` checks what ties sections together: the schedulers that
    rules and actions name, what needs `prometheus.url` or `notify.url`, unique rule names."""

    rules: tuple[Rule, ...] = setting(nonempty="rules (match -> actions)")
    auth: AuthConfig
    host: str = setting("127.0.0.1", key="listen.host")
    port: int = setting(9095, key="listen.port", maximum=65535)
    database: str = setting("bridge.db", parse=_database)
    max_body_bytes: int = setting(1 << 20, minimum=1024)
    max_alerts: int = setting(1000, minimum=1)
    workers: int = setting(4, minimum=1)
    dry_run: bool = False
    prometheus_url: str | None = setting(None, key="prometheus.url")
    sidecars: SidecarEndpoints = setting(factory=lambda: SidecarEndpoints(configured=False))
    schedulers: Mapping[str, SchedulerConfig] = setting(factory=dict)
    default_scheduler: str | None = None  # None: the only scheduler, when there is one
    notify: NotifyConfig | None = None
    restart_budget: int = setting(3, key="restart_budget.max_restarts")
    restart_window_s: Duration = setting(3600.0, key="restart_budget.window")
    hang_alert_re: re.Pattern[str] = re.compile(r"(?i).*hang.*")
    run_label: str = "run"
    incidents: IncidentsConfig = field(default_factory=IncidentsConfig)

    def __post_init__(self) -> None:
        schedulers = self.schedulers
        if self.sidecars.discovery_job is not None and not self.prometheus_url:
            raise Refused("sidecars.discovery_job", "needs prometheus.url (the sidecars are that "
                                                    "Prometheus's scrape targets)")
        if self.sidecars.ack_source == "prometheus" and not self.prometheus_url:
            raise Refused("", "sidecars.ack_source is prometheus but prometheus.url is not set")
        default = self.default_scheduler
        if default is None and len(schedulers) == 1:
            default = next(iter(schedulers))
        if default is not None and default not in schedulers:
            raise Refused("default_scheduler", f"no scheduler named {default!r}")
        defined = ", ".join(sorted(schedulers)) or "none"
        rules = []
        for i, rule in enumerate(self.rules):
            where = f"rules[{i}]"
            rule = dataclasses.replace(rule, name=rule.name or where,
                                       scheduler=rule.scheduler or default)
            if rule.scheduler is not None and rule.scheduler not in schedulers:
                raise Refused(f"{where}.scheduler",
                              f"no scheduler named {rule.scheduler!r} in `schedulers`")
            for j, action in enumerate(rule.actions):
                name = action.options.get("scheduler")
                if name is not None and name not in schedulers:
                    raise Refused(f"{where}.actions[{j}].scheduler",
                                  f"no scheduler named {name!r} in `schedulers` "
                                  f"(defined: {defined})")
                drains = action.type in ("restart", "drain_node") or (
                    action.type == "selftest" and action.options.get("drain"))
                if drains and not name and rule.scheduler is None:
                    raise Refused(where, f"action {action.type} needs a scheduler: define "
                                  "`schedulers` and set `scheduler` on the rule or the action")
                if action.type == "notify" and self.notify is None:
                    raise Refused("", f"rule {rule.name!r} uses notify but `notify.url` is not set")
            rules.append(rule)
        names = [r.name for r in rules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise Refused("rules", f"names must be unique (repeated: {', '.join(dupes)})")
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "default_scheduler", default)


# ----------------------------------------------------------------------------- entry points
def parse(raw: Any, base_dir: str | Path = ".") -> BridgeConfig:
    """Validate an already-loaded YAML document; relative paths resolve against `base_dir`."""
    return read(BridgeConfig, raw, "", Path(base_dir))


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
