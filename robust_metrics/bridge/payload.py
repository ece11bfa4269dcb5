"""Strict validation of Alertmanager's webhook payload (version 4).

Anything that is not what Alertmanager 0.x sends is refused with a message naming the field, so a
misconfigured sender sees a 4xx it can act on and the bridge never guesses. Reference:
https://prometheus.io/docs/alerting/latest/configuration/#webhook_config

Two normalisations make what is accepted safe to key on, store and return:
- `startsAt` is rewritten to one spelling per instant (`canonical_time`: UTC, `Z`, fraction without
  trailing zeros, as Alertmanager writes it), so the idempotency key (`incident_key`) of one alert
  instance does not depend on how a sender spells its time;
- text is valid Unicode: a lone surrogate (JSON allows `"\\ud800"`, UTF-8 cannot hold it) becomes
  U+FFFD, so every label can be stored in SQLite and returned as UTF-8 JSON.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = ["Alert", "Notification", "PayloadError", "canonical_time", "incident_key",
           "parse_notification", "parse_time", "safe_text"]

MAX_LABELS = 128
MAX_STRING = 4096


class PayloadError(ValueError):
    """The payload is not a valid Alertmanager v4 webhook; the message names the field."""


def _time_parts(value: str) -> tuple[datetime, str]:
    """RFC 3339 into (the instant to the second, the fraction's digits); ValueError if not."""
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    digits = ""
    if "." in text:  # Python takes at most microseconds: keep the digits apart
        head, _, rest = text.partition(".")
        n = 0
        while n < len(rest) and rest[n] in "0123456789":
            n += 1
        digits, text = rest[:n], head + rest[n:]
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        raise ValueError(f"time {value!r} has no time zone")
    if not digits and parsed.microsecond:
        digits = f"{parsed.microsecond:06d}"
    return parsed.replace(microsecond=0), digits


def parse_time(value: str) -> datetime:
    """RFC 3339 as Alertmanager writes it (nanoseconds and `Z` included); ValueError if not."""
    parsed, digits = _time_parts(value)
    return parsed.replace(microsecond=int((digits + "000000")[:6]))


def canonical_time(value: str) -> str:
    """One spelling per instant: `2026-01-01T02:00:00.500+02:00` -> `2026-01-01T00:00:00.5Z`
    (UTC, nanoseconds kept, trailing zeros dropped: Go's RFC3339Nano, what Alertmanager sends)."""
    parsed, digits = _time_parts(value)
    try:
        utc = parsed.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"time {value!r} is out of range") from None
    fraction = digits[:9].rstrip("0")
    return utc.replace(tzinfo=None).isoformat() + (f".{fraction}" if fraction else "") + "Z"


def incident_key(fingerprint: str, starts_at: str) -> str:
    """The idempotency key of one alert instance (Alertmanager keeps startsAt across re-sends);
    the time is canonical, so spellings of one instant share one key."""
    return f"{fingerprint}@{canonical_time(starts_at)}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_text(value: str) -> str:
    """`value` with lone surrogates replaced by U+FFFD (the rest unchanged)."""
    return value if value.isascii() else _SURROGATE.sub("\ufffd", value)


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
            raise PayloadError(f"{where}.{safe_text(k)}: expected a string of at most "
                               f"{MAX_STRING} characters")
    return {safe_text(k): safe_text(v) for k, v in value.items()}


def _string(obj: Mapping[str, Any], key: str, where: str, *, required: bool = True,
            max_len: int = MAX_STRING) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise PayloadError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise PayloadError(f"{where}.{key}: longer than {max_len} characters")
    return safe_text(value)


def _time(obj: Mapping[str, Any], key: str, where: str, *, required: bool) -> str:
    value = _string(obj, key, where, required=required, max_len=64)
    if not value:
        if required:
            raise PayloadError(f"{where}.{key}: is empty")
        return ""
    try:
        return canonical_time(value)
    except ValueError:
        raise PayloadError(f"{where}.{key}: not an RFC 3339 time: {value!r}") from None


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
