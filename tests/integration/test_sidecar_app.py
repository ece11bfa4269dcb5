"""A real sidecar process: TLS from its web config (plain HTTP not served), and SIGTERM stops it
and releases the archive. In process: tests/test_sidecar_app.py."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from robust_metrics.sidecar.cli import build
from tests.support import SidecarProcess, require_binary, sidecar_config, wait_until


def test_tls_from_web_config(tmp_path: Path) -> None:
    openssl = require_binary("openssl")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                   "  min_version: TLS12\n")
    args = ["--web-config", str(web), "--no-collector.nvml", "--no-collector.nccl"]
    sidecar = SidecarProcess(tmp_path / "m", args, log_path=tmp_path / "sidecar.log")
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        url = sidecar.url.replace("http://", "https://")

        def ready() -> bool:
            if sidecar.proc.poll() is not None:
                raise AssertionError(sidecar.log_tail())
            return httpx.get(f"{url}/healthz", verify=trust, timeout=2).status_code == 200

        wait_until(ready, timeout=30, message="TLS sidecar")
        response = httpx.get(f"{url}/metrics", verify=trust, timeout=5)
        assert response.status_code == 200 and "robust_sidecar_collector_success" in response.text
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{sidecar.url}/healthz", timeout=2)  # plain HTTP is not served
    finally:
        sidecar.stop()


def test_sigterm_stops_the_sidecar_and_releases_the_archive(tmp_path: Path) -> None:
    sidecar = SidecarProcess(tmp_path / "metrics", ["--no-collector.nvml", "--no-collector.nccl"],
                             log_path=tmp_path / "log")
    try:
        sidecar.wait_ready()
        sidecar.proc.send_signal(15)
        code = sidecar.proc.wait(timeout=15)
        assert code in (0, -15), sidecar.log_tail()  # uvicorn re-raises the signal after shutdown
        assert "Traceback" not in sidecar.log_tail()
    finally:
        sidecar.stop()
    _, folder, _ = build(sidecar_config(tmp_path))  # make_config's folder is tmp_path/metrics
    assert folder.owner, "the next sidecar must get the archive lock"
    folder.close()
