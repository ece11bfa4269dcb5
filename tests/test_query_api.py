"""QueryAPI error answers: an engine's error reaches the caller as a ServiceError with its text."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from robust_metrics.processes import QueryAPI, ServiceError


class _Engine(QueryAPI):
    def __init__(self, url: str) -> None:
        self.url = url


def _serve(status: int, content_type: str, body: bytes) -> Iterator[_Engine]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield _Engine(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def plain_text_error() -> Iterator[_Engine]:
    """VictoriaMetrics answers a query over its series limit in plain text, not JSON."""
    yield from _serve(422, "text/plain", b"cannot select more than 300000 unique time series")


@pytest.fixture
def json_error() -> Iterator[_Engine]:
    yield from _serve(400, "application/json",
                      b'{"status":"error","errorType":"bad_data","error":"parse error"}')


def test_a_plain_text_error_is_a_service_error_with_its_text(plain_text_error: _Engine) -> None:
    with pytest.raises(ServiceError, match="HTTP 422: cannot select more than 300000"):
        plain_text_error.query("up")


def test_a_json_error_keeps_the_engines_type_and_message(json_error: _Engine) -> None:
    with pytest.raises(ServiceError, match="bad_data: parse error"):
        json_error.query("up")
