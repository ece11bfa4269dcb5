"""One configuration layer: one error type for every deployable, one way to give a secret."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from robust_metrics import configuration
from robust_metrics.bridge import config as bridge_config
from robust_metrics.bridge.schedulers import base
from robust_metrics.configuration import ConfigError, Secret, resolve_secret, secret_ref
from robust_metrics.sidecar import config as sidecar_config
from tests.support import ROOT


def test_one_error_type() -> None:
    assert bridge_config.ConfigError is sidecar_config.ConfigError is configuration.ConfigError
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(("name", "options"), [
    ("local", {}), ("local", {"command": ["x"], "colour": 1}), ("webhook", {"url": "ftp://x"}),
    ("webhook", {"url": "http://x", "secret": "a", "secret_env": "B"}),
    ("slurm", {"api_version": "0.0.38"}), ("slurm", {"token": "a", "token_file": "b"}),
    ("kubernetes", {"kind": "Deployment"}), ("pbs", {}),
])
def test_every_scheduler_config_error_is_a_config_error(name: str, options: dict[str, Any]
                                                        ) -> None:
    with pytest.raises(ConfigError):
        base.create(name, options)


def test_secret_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tok").write_text("  from-file\n")
    assert resolve_secret({"token": "inline"}, "token", "x") == "inline"
    assert resolve_secret({"token_file": "tok"}, "token", "x", tmp_path) == "from-file"
    monkeypatch.setenv("ROBUST_TEST_SECRET", "from-env")
    assert resolve_secret({"token_env": "ROBUST_TEST_SECRET"}, "token", "x") == "from-env"
    assert resolve_secret({}, "token", "x") is None
    for data, message in [
        ({"token": "a", "token_file": "b"}, "x: give only one of token, token_file"),
        ({"token_file": "missing"}, "x: cannot read token_file"),
        ({"token_env": "ROBUST_TEST_UNSET"}, "environment variable ROBUST_TEST_UNSET"),
        ({"token": ""}, "x: token is empty"),
        ({"token": 123456}, "x.token: expected a string, got int"),
    ]:
        with pytest.raises(ConfigError) as err:
            resolve_secret(data, "token", "x", tmp_path)
        assert message in str(err.value) and "123456" not in str(err.value)


def test_a_secret_file_is_read_again_when_rotated(tmp_path: Path) -> None:
    (tmp_path / "jwt").write_text("one")
    ref = secret_ref({"token_file": "jwt"}, "token", "slurm scheduler", tmp_path)
    assert isinstance(ref, Secret) and ref.read() == "one"
    (tmp_path / "jwt").write_text("two")
    assert ref.read() == "two"


def test_every_secret_of_the_bridge_takes_the_three_forms(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """auth, sidecars, notify and the webhook scheduler resolve secrets the same way."""
    (tmp_path / "s").write_text("file-secret\n")
    monkeypatch.setenv("ROBUST_TEST_SECRET", "env-secret")
    raw = {"auth": {"bearer_token_file": "s", "basic": {"username": "u",
                                                        "password_env": "ROBUST_TEST_SECRET"}},
           "sidecars": {"token_file": "s"}, "notify": {"url": "http://h", "secret": "inline"},
           "schedulers": {"hook": {"type": "webhook", "url": "http://h", "secret_file": "s"}},
           "rules": [{"match": {"a": "b"}, "actions": ["notify"]}]}
    config = bridge_config.parse(raw, tmp_path)
    assert (config.auth.bearer_token, config.auth.basic_password, config.sidecars.token,
            config.notify and config.notify.secret) == (
        "file-secret", "env-secret", "file-secret", "inline")
    hook = config.schedulers["hook"].create()
    try:
        assert hook.secret == "file-secret"  # type: ignore[attr-defined]
    finally:
        hook.close()  # type: ignore[attr-defined]


def test_bad_scheduler_config_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text(
        "auth: {bearer_token: t}\nschedulers: {ops: {type: webhook, url: http://h, "
        "secret_file: nope}}\nrules: [{match: {a: b}, actions: [{type: restart}]}]\n")
    out = subprocess.run([sys.executable, "-m", "robust_metrics", "bridge", "--config",
                          str(tmp_path / "b.yaml"), "--check"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "cannot read secret_file" in out.stderr
