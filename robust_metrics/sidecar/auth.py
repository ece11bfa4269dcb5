"""Who may talk to the sidecar: a bearer token for the powerful endpoints, TLS and basic auth from a
Prometheus-style web config.

`/debug/*` (stack dumps read process memory) and `/control/*` (checkpoints) act on the training job,
so they always need `Authorization: Bearer <token>` with the token from `--token-file`; without a
token file they are disabled (403). `/metrics` follows the web config, in the format of
prometheus/exporter-toolkit (a subset)::

    tls_server_config:
      cert_file: /etc/robust-metrics/tls.crt
      key_file: /etc/robust-metrics/tls.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert, VerifyClientCertIfGiven
      client_ca_file: /etc/robust-metrics/ca.crt
      min_version: TLS12                               # TLS10..TLS13
    basic_auth_users:
      prometheus: $2y$10$...                            # bcrypt hash (htpasswd -nBC 10 "" )

Basic auth guards `/metrics` only; `/healthz` stays open for liveness probes, and `/debug` and
`/control` take the bearer token instead (one Authorization header cannot carry both).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

import yaml

from robust_metrics.sidecar.config import ConfigError

__all__ = ["BasicAuth", "TlsSettings", "TokenFile", "WebConfig", "load_web_config"]

_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


@dataclass(frozen=True)
class TlsSettings:
    cert_file: str
    key_file: str
    client_auth: ssl.VerifyMode = ssl.CERT_NONE
    client_ca_file: str | None = None
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2


@dataclass
class WebConfig:
    tls: TlsSettings | None = None
    basic_auth: BasicAuth | None = None


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes; remembers successes (bcrypt is slow
    on purpose, and Prometheus sends the same credentials every scrape)."""

    def __init__(self, users: dict[str, str]) -> None:
        try:
            import bcrypt
        except ImportError:
            raise ConfigError("basic_auth_users needs the bcrypt package "
                              "(pip install 'robust-metrics[sidecar]')") from None
        self._bcrypt = bcrypt
        self.users = {u: h.encode() for u, h in users.items()}
        self._ok: set[tuple[str, bytes]] = set()
        self._lock = threading.Lock()

    def check(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if hashed is None:
            return False
        key = (user, hashlib.sha256(password.encode() + hashed).digest())
        with self._lock:
            if key in self._ok:
                return True
        try:
            ok = self._bcrypt.checkpw(password.encode(), hashed)
        except ValueError:
            ok = False
        if ok:
            with self._lock:
                if len(self._ok) > 1000:
                    self._ok.clear()
                self._ok.add(key)
        return ok


@dataclass
class TokenFile:
    """The bearer token, re-read when the file changes so it can be rotated without a restart."""

    path: str
    _token: bytes = b""
    _mtime: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self) -> None:
        """Read the token; ConfigError when the file is unreadable or empty."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
            with open(self.path, "rb") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {self.path}: cannot read it: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"--token-file {self.path}: the file is empty")
        with self._lock:
            self._token, self._mtime = token, mtime

    def check(self, header: str | None) -> bool:
        """True when the header is `Bearer <the token>` (compared in constant time)."""
        try:
            if os.stat(self.path).st_mtime_ns != self._mtime:
                self.load()
        except ConfigError:
            return False  # rotated to something unreadable: refuse rather than serve open
        except OSError:
            return False
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[7:].strip().encode(), self._token)


def _need(section: dict[str, Any], key: str, where: str) -> str:
    value = section.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"web config: {where}.{key} is required (a file path)")
    return value


def _readable(path: str, what: str) -> str:
    if not os.access(path, os.R_OK):
        raise ConfigError(f"web config: {what} {path} is not readable")
    return path


def load_web_config(path: str) -> WebConfig:
    """Parse and check a web config file; ConfigError names the first problem."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--web-config {path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--web-config {path}: not valid YAML: {exc}") from None
    if data is None:
        return WebConfig()
    if not isinstance(data, dict):
        raise ConfigError(f"--web-config {path}: expected a mapping at the top level")
    unknown = set(data) - {"tls_server_config", "basic_auth_users"}
    if unknown:
        raise ConfigError(f"--web-config {path}: unknown key(s) {', '.join(sorted(unknown))}; "
                          "supported: tls_server_config, basic_auth_users")
    config = WebConfig()
    tls = data.get("tls_server_config")
    if tls is not None:
        if not isinstance(tls, dict):
            raise ConfigError("web config: tls_server_config must be a mapping")
        known = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version"}
        unknown = set(tls) - known
        if unknown:
            raise ConfigError(f"web config: tls_server_config: unsupported key(s) "
                              f"{', '.join(sorted(unknown))}; supported: {', '.join(sorted(known))}")
        auth_type = tls.get("client_auth_type", "NoClientCert")
        if auth_type not in _CLIENT_AUTH:
            raise ConfigError(f"web config: client_auth_type {auth_type!r}: choose one of "
                              f"{', '.join(_CLIENT_AUTH)}")
        version = tls.get("min_version", "TLS12")
        if version not in _TLS_VERSIONS:
            raise ConfigError(f"web config: min_version {version!r}: choose one of "
                              f"{', '.join(_TLS_VERSIONS)}")
        ca = tls.get("client_ca_file")
        if _CLIENT_AUTH[auth_type] != ssl.CERT_NONE and not ca:
            raise ConfigError(f"web config: client_auth_type {auth_type} needs client_ca_file")
        settings = TlsSettings(
            cert_file=_readable(_need(tls, "cert_file", "tls_server_config"), "cert_file"),
            key_file=_readable(_need(tls, "key_file", "tls_server_config"), "key_file"),
            client_auth=_CLIENT_AUTH[auth_type],
            client_ca_file=_readable(ca, "client_ca_file") if ca else None,
            min_version=_TLS_VERSIONS[version])
        try:  # fail now, with the reason, rather than at the first connection
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(settings.cert_file, settings.key_file)
            if settings.client_ca_file:
                context.load_verify_locations(settings.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"web config: cannot load the TLS certificate or key: {exc}") from None
        config.tls = settings
    users = data.get("basic_auth_users")
    if users is not None:
        if not isinstance(users, dict) or not all(
                isinstance(u, str) and isinstance(h, str) and h.startswith("$2")
                for u, h in users.items()):
            raise ConfigError("web config: basic_auth_users must map user names to bcrypt hashes "
                              "($2y$...)")
        config.basic_auth = BasicAuth(users)
    return config
