"""Configuration errors and secrets, one way for every deployable (bridge, its scheduler adapters,
the sidecar).

- `ConfigError`: a setting that cannot work. The message names the key and what is expected, and
  every command exits with status 2 on it, before it serves or acts.
- Secrets are given one of three ways, never two: inline (`token: ...`), in a file
  (`token_file: path`, relative to the configuration file's folder, surrounding whitespace
  stripped) or in an environment variable (`token_env: NAME`). `secret_ref` checks which one a
  mapping uses and returns a `Secret`; `Secret.read()` resolves it, and can be called again to pick
  up a rotated file (the Slurm JWT); `resolve_secret` does both at once for secrets read at start.

Nothing here imports more than the standard library: the sidecar and the bridge both use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["ConfigError", "Secret", "resolve_secret", "secret_ref"]


class ConfigError(ValueError):
    """A setting that cannot work; the message names it. Commands exit with status 2."""


@dataclass(frozen=True)
class Secret:
    """Where a secret is: `kind` inline (`ref` is the value), file (`ref` a path) or env."""

    where: str
    name: str  # the key that gave it: token, token_file, token_env, ...
    kind: Literal["inline", "file", "env"]
    ref: str

    def read(self) -> str:
        """The secret now; ConfigError when the file or variable is missing or empty."""
        if self.kind == "file":
            try:
                value = Path(self.ref).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"{self.where}: cannot read {self.name} {self.ref}: "
                                  f"{exc.strerror}") from None
        elif self.kind == "env":
            value = os.environ.get(self.ref, "")
            if not value:
                raise ConfigError(f"{self.where}: environment variable {self.ref} "
                                  f"({self.name}) is not set")
        else:
            value = self.ref
        if not value:
            raise ConfigError(f"{self.where}: {self.name} is empty")
        return value


def secret_ref(data: Mapping[str, Any], key: str, where: str, base: str | Path = ".",
               ) -> Secret | None:
    """The secret `key` of `data` (`key`, `key_file` or `key_env`), or None when none is given."""
    given = [k for k in (key, f"{key}_file", f"{key}_env") if data.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"{where}: give only one of {', '.join(given)}")
    if not given:
        return None
    name = given[0]
    value = data[name]
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{name}: expected a string, got {type(value).__name__} "
                          "(quote it in YAML)")  # never echo a secret
    if name.endswith("_file"):
        return Secret(where, name, "file", str((Path(base) / value).expanduser()))
    if name.endswith("_env"):
        return Secret(where, name, "env", value)
    return Secret(where, name, "inline", value)


def resolve_secret(data: Mapping[str, Any], key: str, where: str, base: str | Path = ".",
                   ) -> str | None:
    """`secret_ref(...).read()`: the secret's value now, or None when none is given."""
    ref = secret_ref(data, key, where, base)
    return None if ref is None else ref.read()
