"""Prometheus remote write (protocol 1.0) from tests: Prometheus (with
`--web.enable-remote-write-receiver`) and VictoriaMetrics both accept it at `/api/v1/write`, so
one data set reaches both engines byte for byte, with explicit timestamps and staleness markers.

The payload is a protobuf `WriteRequest` compressed with snappy. Both are written by hand here
(a few lines each) so the tests need neither protobuf nor a snappy library: the snappy stream uses
literal elements only, which every decoder accepts.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

import httpx

__all__ = ["STALE", "Series", "encode_write_request", "push", "snappy_literal"]

# Prometheus' staleness marker: a NaN with this exact bit pattern ends a series at that time.
STALE = object()
_STALE_BITS = 0x7FF0000000000002

Series = tuple[Mapping[str, str], Sequence[tuple[int, float | object]]]  # labels, (ms, value)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _sample(ms: int, value: float | object) -> bytes:
    bits = struct.pack("<Q", _STALE_BITS) if value is STALE else struct.pack("<d", value)
    return b"\x09" + bits + _varint(2 << 3) + _varint(ms & 0xFFFFFFFFFFFFFFFF)


def encode_write_request(series: Iterable[Series]) -> bytes:
    """The protobuf bytes of a WriteRequest (labels sorted by name, as receivers require)."""
    out = bytearray()
    for labels, samples in series:
        body = b"".join(_bytes_field(1, _bytes_field(1, k.encode()) + _bytes_field(2, v.encode()))
                        for k, v in sorted(labels.items()))
        body += b"".join(_bytes_field(2, _sample(ms, value)) for ms, value in samples)
        out += _bytes_field(1, body)
    return bytes(out)


def snappy_literal(data: bytes) -> bytes:
    """A valid snappy block holding `data` uncompressed (literal elements of at most 64 KiB)."""
    out = bytearray(_varint(len(data)))
    for start in range(0, len(data), 65536):
        chunk = data[start:start + 65536]
        n = len(chunk) - 1
        if n < 60:
            out.append(n << 2)
        else:
            out.append(61 << 2)  # two bytes of length follow
            out += struct.pack("<H", n)
        out += chunk
    return bytes(out)


def push(client: httpx.Client, url: str, series: Iterable[Series]) -> None:
    """POST the series to `url` (…/api/v1/write); raises with the receiver's message on error."""
    response = client.post(url, content=snappy_literal(encode_write_request(series)), headers={
        "Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
        "X-Prometheus-Remote-Write-Version": "0.1.0"}, timeout=60)
    if response.status_code >= 300:
        raise AssertionError(f"remote write to {url}: {response.status_code} {response.text}")
