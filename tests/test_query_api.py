"""QueryAPI error answers: an engine's error reaches the caller as a ServiceError with its text."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from robust_metrics.processes import QueryAPI, ServiceError
from tests.bridge_fakes import StubServer, send_reply


class _Engine(QueryAPI):
    def __init__(self, url: str) -> None:
        self.url = url


def _engine_answering(status: int, body: bytes, ctype: str) -> Iterator[_Engine]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            send_reply(self, status, body, ctype)

        def log_message(self, *args: object) -> None:
            pass

    with StubServer(Handler) as server:
        yield _Engine(server.url)


@pytest.fixture
def plain_text_error() -> Iterator[_Engine]:
    """VictoriaMetrics answers some errors in plain text, not JSON: this one ended the
    65,536-rank benchmark while vmalert held every search slot."""
    yield from _engine_answering(
        503, b"cannot handle more than 4 concurrent search requests during 10s", "text/plain")


@pytest.fixture
def json_error() -> Iterator[_Engine]:
    yield from _engine_answering(
        400, b'{"status":"error","errorType":"bad_data","error":"parse error"}',
        "application/json")


def test_a_plain_text_error_is_a_service_error_with_its_text(plain_text_error: _Engine) -> None:
    with pytest.raises(ServiceError,
                       match="HTTP 503: cannot handle more than 4 concurrent search requests"):
        plain_text_error.query("up")


def test_a_json_error_keeps_the_engines_type_and_message(json_error: _Engine) -> None:
    with pytest.raises(ServiceError, match="bad_data: parse error"):
        json_error.query("up")
