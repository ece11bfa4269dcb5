"""The `webhook` scheduler: every operation is a signed JSON POST to a service you run.

For schedulers the bridge has no adapter for (an internal job service, a ChatOps bot, a runbook
automation): the receiver gets ``{"operation": "restart", "run": ..., "reason": ...}`` with an
HMAC-SHA256 signature header (see `robust_metrics.bridge.signing`) and an `Idempotency-Key`
header naming the bridge step, so it can drop a request it has already handled.

Config::

    schedulers:
      ops:
        type: webhook
        url: https://jobs.example.com/hooks/robust
        secret_file: /etc/robust/webhook.secret   # or secret / secret_env
        timeout_s: 10
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from robust_metrics.bridge.schedulers.base import ActionResult, SchedulerError, check_keys, register
from robust_metrics.bridge.signing import signed_request
from robust_metrics.configuration import ConfigError, resolve_secret

__all__ = ["WebhookScheduler"]

_KEYS = {"url", "secret", "secret_file", "secret_env", "timeout_s", "headers"}


class WebhookScheduler:
    """Scheduler operations as signed HTTP POSTs; a 2xx answer means the receiver took it."""

    name = "webhook"

    def __init__(self, config: Mapping[str, Any], *, base_dir: str | Path = ".") -> None:
        """`base_dir`: the folder a relative `secret_file` is read from (the policy file's)."""
        check_keys(config, _KEYS, "webhook")
        url = config.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"webhook scheduler: `url` must be an http(s) URL, got {url!r}")
        self.url = url
        self.secret = resolve_secret(config, "secret", "webhook scheduler", base_dir)
        self.timeout_s = float(config.get("timeout_s", 10.0))
        headers = config.get("headers") or {}
        if not isinstance(headers, Mapping):
            raise ConfigError("webhook scheduler: `headers` must be a mapping")
        self.headers = {str(k): str(v) for k, v in headers.items()}
        self._http = httpx.Client(timeout=self.timeout_s)  # reused: no TLS set-up per request

    def _post(self, payload: dict[str, Any], key: str | None) -> ActionResult:
        payload = {**payload, "sent_at": time.time()}
        body, headers = signed_request(payload, self.secret, key)
        try:
            response = self._http.post(self.url, content=body,
                                       headers={**self.headers, **headers})
        except httpx.HTTPError as exc:
            raise SchedulerError(f"webhook {self.url} unreachable: {exc!r}") from exc
        text = response.text[:500]
        if response.is_success:
            try:
                data = response.json() if text else {}
            except ValueError:
                data = {"body": text}
            return ActionResult(True, f"{payload['operation']} accepted by {self.url} "
                                f"(HTTP {response.status_code})",
                                data if isinstance(data, dict) else {"body": data})
        return ActionResult(False, f"{self.url} answered HTTP {response.status_code}: {text}")

    def signal(self, run: str, signum: int, *, key: str | None = None) -> ActionResult:
        return self._post({"operation": "signal", "run": run, "signum": int(signum)}, key)

    def restart(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        return self._post({"operation": "restart", "run": run, "reason": reason}, key)

    def drain_node(self, node: str, reason: str, *, key: str | None = None) -> ActionResult:
        return self._post({"operation": "drain_node", "node": node, "reason": reason}, key)

    def cancel(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        return self._post({"operation": "cancel", "run": run, "reason": reason}, key)

    def completed(self, run: str, key: str) -> bool | None:
        """Whether the step `key` reached the receiver: unknowable from here."""
        return None

    def close(self) -> None:
        self._http.close()


@register("webhook")
def _factory(config: Mapping[str, Any], base_dir: Path) -> WebhookScheduler:
    return WebhookScheduler(config, base_dir=base_dir)
