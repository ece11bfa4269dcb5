"""HMAC-SHA256 signatures for the JSON the bridge POSTs (webhook scheduler, notify).

The receiver recomputes the signature over the timestamp and the raw body with the shared secret
and compares in constant time; the timestamp in the signed text lets it refuse replays older than a
few minutes. Same scheme as GitHub's `X-Hub-Signature-256`, plus a timestamp as Stripe does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

__all__ = [
    "IDEMPOTENCY_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "header_key",
    "signature",
    "signed_request",
    "verify",
]

SIGNATURE_HEADER = "X-Robust-Signature-256"
TIMESTAMP_HEADER = "X-Robust-Timestamp"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """`sha256=<hex>` of HMAC-SHA256(secret, timestamp + "." + body)."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def header_key(key: str) -> str:
    """`key` as an HTTP header value: UTF-8 percent-encoded outside printable ASCII, `%` and space.

    Header values are ASCII; fingerprints come from alert senders and may not be. Keys made of
    Alertmanager's hex fingerprints and RFC 3339 times are unchanged; `urllib.parse.unquote`
    gives the key back.
    """
    return quote(key, safe="!#$&'()*+,/:;=?@[]^_`{|}~-.", errors="surrogatepass")


def signed_request(payload: Mapping[str, Any], secret: str | None,
                   key: str | None = None) -> tuple[bytes, dict[str, str]]:
    """The body and headers to POST: JSON, a timestamp, the signature when a secret is set."""
    body = json.dumps(dict(payload), sort_keys=True, default=str).encode()
    timestamp = str(int(time.time()))
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: timestamp,
               "User-Agent": "robust-metrics-bridge"}
    if secret:
        headers[SIGNATURE_HEADER] = signature(secret, timestamp, body)
    if key:
        headers[IDEMPOTENCY_HEADER] = header_key(key)
    return body, headers


def verify(secret: str, headers: Mapping[str, str], body: bytes, *,
           max_age_s: float = 300.0, now: float | None = None) -> bool:
    """Receiver side: True when the signature matches and the timestamp is recent."""
    lower = {k.lower(): v for k, v in headers.items()}
    timestamp = lower.get(TIMESTAMP_HEADER.lower(), "")
    given = lower.get(SIGNATURE_HEADER.lower(), "")
    try:
        age = (time.time() if now is None else now) - int(timestamp)
    except ValueError:
        return False
    if abs(age) > max_age_s:
        return False
    return hmac.compare_digest(signature(secret, timestamp, body), given)
