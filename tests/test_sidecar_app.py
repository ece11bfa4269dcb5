"""The sidecar's HTTP face and command line: auth, bad input, config faults, no torch. A real
sidecar process serving TLS and stopping on SIGTERM: tests/integration/test_sidecar_app.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from starlette.testclient import TestClient

from robust_metrics.rankfolder import control
from robust_metrics.sidecar.auth import load_web_config
from robust_metrics.sidecar.cli import EXIT_BIND, EXIT_CONFIG, build
from robust_metrics.sidecar.config import ConfigError, parse_listen
from tests.support import ROOT, sidecar_config

TOKEN = "s3cret-token"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def client(tmp_path: Path, token_file: Path) -> Iterator[TestClient]:
    app, _, _ = build(sidecar_config(tmp_path, token_file=str(token_file)))
    with TestClient(app) as c:
        yield c


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_importing_and_building_the_sidecar_never_imports_torch_or_the_hook(
        tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from robust_metrics.sidecar.cli import build\n"
        "from robust_metrics.sidecar.config import SidecarConfig\n"
        "import robust_metrics.sidecar.collectors, robust_metrics.sidecar.app\n"
        f"app, folder, _ = build(SidecarConfig(directory={str(tmp_path / 'm')!r}, "
        "collectors=['ranks', 'process', 'nvml', 'nic', 'nccl']))\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch'\n"
        "       or m.startswith('robust_metrics.hooks')]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr.decode()


def test_missing_folder_is_created(tmp_path: Path) -> None:
    config = sidecar_config(tmp_path)
    assert not os.path.exists(config.directory)
    _, folder, _ = build(config)
    assert os.path.isdir(os.path.join(config.directory, "ranks"))
    folder.close()


def test_metrics_and_healthz(client: TestClient) -> None:
    assert client.get("/healthz").text == "ok\n"
    response = client.get("/metrics")
    assert response.status_code == 200
    assert 'robust_sidecar_collector_success{collector="ranks",node="n1"} 1.0' in response.text
    om = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    assert client.get("/nope").status_code == 404


def test_debug_and_control_need_the_bearer_token(client: TestClient) -> None:
    for method, path in (("GET", "/debug/stacks"), ("POST", "/control/checkpoint")):
        assert client.request(method, path).status_code == 401
        response = client.request(method, path, headers=bearer("wrong"))
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert "Bearer" in response.json()["error"]


def test_without_token_file_debug_and_control_are_disabled(tmp_path: Path) -> None:
    app, _, _ = build(sidecar_config(tmp_path))
    with TestClient(app) as c:
        response = c.post("/control/checkpoint", headers=bearer())
        assert response.status_code == 403
        assert "--token-file" in response.json()["error"]
        assert c.get("/debug/stacks", headers=bearer()).status_code == 403


def test_checkpoint_request_is_written_for_the_hook(client: TestClient, tmp_path: Path) -> None:
    directory = str(tmp_path / "metrics")
    response = client.post("/control/checkpoint", headers=bearer(), json={"at_step": 120})
    assert response.status_code == 202, response.text
    body = response.json()
    request = control.read_checkpoint_request(directory)
    assert request is not None and request.id == body["request_id"] and request.at_step == 120
    again = client.post("/control/checkpoint?at_step=7", headers=bearer())
    assert again.status_code == 202 and again.json()["request_id"] >= body["request_id"]
    assert control.read_checkpoint_request(directory).at_step == 7


@pytest.mark.parametrize("kwargs", [
    {"json": {"at_step": -1}}, {"json": {"at_step": "soon"}}, {"json": {"step": 3}},
    {"json": [1]}, {"content": b"{not json"}, {"params": {"at_step": "x"}},
    # int() of these raised OverflowError (a 500), made step 1.5 step 1, and wrote steps the
    # hook refuses (it reads them only below 2**53)
    {"content": b'{"at_step": 1e999}'}, {"content": b'{"at_step": -Infinity}'},
    {"content": b'{"at_step": 1.5}'}, {"json": {"at_step": True}},
    {"json": {"at_step": 2**53}}, {"params": {"at_step": str(2**60)}},
    {"params": {"at_step": "1e999"}}, {"params": {"at_step": "1.5"}},
])
def test_bad_checkpoint_requests_get_400(client: TestClient, kwargs: dict) -> None:
    response = client.post("/control/checkpoint", headers=bearer(), **kwargs)
    assert response.status_code == 400, response.text
    assert response.json()["error"]


def test_checkpoint_is_post_only(client: TestClient) -> None:
    assert client.get("/control/checkpoint", headers=bearer()).status_code == 405


@pytest.mark.parametrize("query", ["native=maybe", "locals=2", "timeout=abc", "timeout=0"])
def test_bad_stack_queries_get_400(client: TestClient, query: str) -> None:
    response = client.get(f"/debug/stacks?{query}", headers=bearer())
    assert response.status_code == 400, response.text


def test_stacks_with_no_ranks_is_an_empty_list(client: TestClient) -> None:
    response = client.get("/debug/stacks", headers=bearer())
    assert response.status_code == 200
    assert response.json() == {"node": "n1", "ranks": []}


def test_basic_auth_guards_metrics_but_not_healthz(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")
    app, _, _ = build(sidecar_config(tmp_path, web_config=str(web)))
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        denied = c.get("/metrics")
        assert denied.status_code == 401 and "Basic" in denied.headers["www-authenticate"]
        assert c.get("/metrics", auth=("prom", "wrong")).status_code == 401
        assert c.get("/metrics", auth=("nobody", "pw")).status_code == 401
        assert c.get("/metrics", auth=("prom", "pw")).status_code == 200
        assert c.get("/metrics", auth=("prom", "pw")).status_code == 200  # cached path
        assert c.get("/metrics", headers={"Authorization": "Basic !!!"}).status_code == 401


@pytest.mark.parametrize("text, message", [
    ("tls_server_config: [1]\n", "must be a mapping"),
    ("listen: 1\n", "unknown key"),
    ("basic_auth_users:\n  prom: plaintext\n", "bcrypt"),
    ("tls_server_config:\n  key_file: /nope\n", "cert_file is required"),
    ("tls_server_config:\n  cert_file: /nope\n  key_file: /nope\n", "not readable"),
    ("tls_server_config:\n  cert_file: X\n  key_file: X\n  client_auth_type: Maybe\n",
     "client_auth_type"),
    ("a: [unclosed\n", "not valid YAML"),
])
def test_bad_web_config_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(text.replace("X", str(path)))
    with pytest.raises(ConfigError, match=message):
        load_web_config(str(path))


def test_listen_parsing() -> None:
    assert parse_listen("127.0.0.1:9741") == ("127.0.0.1", 9741)
    assert parse_listen(":9741") == ("0.0.0.0", 9741)
    assert parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("9741", "host:port", "h:70000"):
        with pytest.raises(ConfigError):
            parse_listen(bad)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robust_metrics", "sidecar", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_cli_exit_codes_for_config_faults(tmp_path: Path) -> None:
    directory = str(tmp_path / "m")
    unreadable = run_cli("--dir", directory, "--token-file", str(tmp_path / "missing"))
    assert unreadable.returncode == EXIT_CONFIG
    assert "--token-file" in unreadable.stderr and "cannot read" in unreadable.stderr
    (tmp_path / "empty").write_text("\n")
    empty = run_cli("--dir", directory, "--token-file", str(tmp_path / "empty"))
    assert empty.returncode == EXIT_CONFIG and "empty" in empty.stderr
    (tmp_path / "web.yml").write_text("nonsense: 1\n")
    web = run_cli("--dir", directory, "--web-config", str(tmp_path / "web.yml"))
    assert web.returncode == EXIT_CONFIG and "unknown key" in web.stderr
    listen = run_cli("--dir", directory, "--listen", "nowhere")
    assert listen.returncode == EXIT_CONFIG and "--listen" in listen.stderr
    peak = run_cli("--dir", directory, "--gpu-peak-flops", "H100=fast")
    assert peak.returncode == EXIT_CONFIG and "--gpu-peak-flops 'H100=fast'" in peak.stderr
    assert "Traceback" not in peak.stderr
    assert run_cli("--dir", directory, "--bogus").returncode == 2  # argparse


def test_cli_port_taken_exits_3(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_cli("--dir", str(tmp_path / "m"), "--listen", f"127.0.0.1:{port}",
                         "--no-collector.nvml", "--no-collector.nccl")
    assert result.returncode == EXIT_BIND, result.stderr
    assert "already in use" in result.stderr
