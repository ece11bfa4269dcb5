"""Strict validation of Alertmanager's webhook payload (version 4).

Anything that is not what Alertmanager 0.x sends is refused with a message naming the field, so a
misconfigured sender sees a 4xx it can act on and the bridge never guesses. Reference:
https://prometheus.io/docs/alerting/latest/configuration/#webhook_config
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from robust_metrics.bridge.policy import parse_time

__all__ = ["Alert", "Notification", "PayloadError", "parse_notification"]

MAX_LABELS = 128
MAX_STRING = 4096


class PayloadError(ValueError):
    """The payload is not a valid Alertmanager v4 webhook; the message names the field."""


@dataclass(frozen=True)
class Alert:
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: str
    ends_at: str
    fingerprint: str


@dataclass(frozen=True)
class Notification:
    status: str
    receiver: str
    group_key: str
    alerts: list[Alert]


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise PayloadError(f"{where}: expected an object of strings")
    if len(value) > MAX_LABELS:
        raise PayloadError(f"{where}: more than {MAX_LABELS} entries")
    for k, v in value.items():
        if not isinstance(v, str) or len(v) > MAX_STRING or len(k) > 256:
            raise PayloadError(f"{where}.{k}: expected a string of at most {MAX_STRING} "
                               "characters")
    return dict(value)


def _string(obj: Mapping[str, Any], key: str, where: str, *, required: bool = True,
            max_len: int = MAX_STRING) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise PayloadError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise PayloadError(f"{where}.{key}: longer than {max_len} characters")
    return value


def _time(obj: Mapping[str, Any], key: str, where: str, *, required: bool) -> str:
    value = _string(obj, key, where, required=required, max_len=64)
    if not value:
        if required:
            raise PayloadError(f"{where}.{key}: is empty")
        return ""
    try:
        parse_time(value)
    except ValueError:
        raise PayloadError(f"{where}.{key}: not an RFC 3339 time: {value!r}") from None
    return value


def _alert(raw: Any, where: str) -> Alert:
    if not isinstance(raw, Mapping):
        raise PayloadError(f"{where}: expected an object")
    status = raw.get("status")
    if status not in ("firing", "resolved"):
        raise PayloadError(f"{where}.status: expected firing or resolved, got {status!r}")
    labels = _string_map(raw.get("labels"), f"{where}.labels")
    if not labels.get("alertname"):
        raise PayloadError(f"{where}.labels.alertname: missing")
    fingerprint = _string(raw, "fingerprint", where, max_len=128)
    if not fingerprint:
        raise PayloadError(f"{where}.fingerprint: is empty")
    annotations = raw.get("annotations")
    return Alert(
        status=status, labels=labels,
        annotations={} if annotations is None else _string_map(annotations,
                                                               f"{where}.annotations"),
        starts_at=_time(raw, "startsAt", where, required=True),
        ends_at=_time(raw, "endsAt", where, required=False),
        fingerprint=fingerprint,
    )


def parse_notification(body: Any, max_alerts: int = 1000) -> Notification:
    """Validate a decoded JSON body; PayloadError says what is wrong."""
    if not isinstance(body, Mapping):
        raise PayloadError("body: expected a JSON object (Alertmanager webhook payload)")
    if body.get("version") != "4":
        raise PayloadError(f"version: expected \"4\" (Alertmanager webhook payload version 4), "
                           f"got {body.get('version')!r}")
    status = body.get("status")
    if status not in ("firing", "resolved"):
        raise PayloadError(f"status: expected firing or resolved, got {status!r}")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    if len(alerts) > max_alerts:
        raise PayloadError(f"alerts: {len(alerts)} alerts, more than the limit of {max_alerts}")
    for key in ("groupLabels", "commonLabels", "commonAnnotations"):
        if body.get(key) is not None:
            _string_map(body[key], key)
    truncated = body.get("truncatedAlerts", 0)
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0:
        raise PayloadError("truncatedAlerts: expected a non-negative integer")
    return Notification(
        status=status,
        receiver=_string(body, "receiver", "body", required=False),
        group_key=_string(body, "groupKey", "body", required=False, max_len=65536),
        alerts=[_alert(a, f"alerts[{i}]") for i, a in enumerate(alerts)],
    )
