"""`control/checkpoint.json`: checkpoint requests reaching a rank from outside, both ends.

The sidecar's `/control/checkpoint` writes `control/checkpoint.json` into the metrics folder
(atomically, by rename); Slurm's convention is SIGUSR1 (`scancel --signal=USR1`). The hook looks at
step boundaries only, so the checkpoint callback runs where the model is consistent, and it adds no
collective: to make every rank checkpoint at the same step, a request may name `at_step`.

The sidecar writes the file (`write_checkpoint_request`) and the hook reads it
(`ControlChannel`); a request can also come as a signal. Neither end follows a link planted in the
folder, and the reader never blocks on a FIFO or reads more than a few KiB.

Kubernetes has no signal API: there the bridge's `kubernetes` scheduler sets the pod annotation
`robust-metrics.io/checkpoint-request` to a request id, the pod projects `metadata.annotations`
into a file with a downward API volume, and the hook (`watch(pod_annotations=PATH)` or
`ROBUST_METRICS_POD_ANNOTATIONS`) reads the id from that file (`read_annotation_request`). The
kubelet writes that file as lines `key="value"` with Go-quoted values; its content comes from
whoever may patch the pod, so a malformed or oversized file is refused (reported through
`on_error`, never raised into training).

Request ids are milliseconds since the epoch, so ids from signals, files and annotations order by
time and the acknowledgement metric (`robust_checkpoint_request_id`) tells a waiter which request
was handled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from robust_metrics.numbers import decimal
from robust_metrics.rankfolder.safeio import open_dir, read_regular, write_atomic

__all__ = ["CHECKPOINT_ANNOTATION", "CHECKPOINT_KEY_ANNOTATION", "CheckpointRequest",
           "ControlChannel", "annotation_request_id", "parse_downward_annotations",
           "read_annotation_request", "request_path", "write_checkpoint_request"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRequest:
    id: int
    at_step: int | None = None


CONTROL_DIR = "control"
REQUEST_FILE = "checkpoint.json"
MAX_REQUEST_BYTES = 4096
CHECKPOINT_ANNOTATION = "robust-metrics.io/checkpoint-request"
"""Pod annotation whose value is a checkpoint request id (set by the `kubernetes` scheduler)."""
CHECKPOINT_KEY_ANNOTATION = "robust-metrics.io/checkpoint-request-key"
"""The bridge step key that set the id: the same key sets the same id again (exactly once)."""
MAX_ANNOTATIONS_BYTES = 512 * 1024  # the API server caps all of a pod's annotations at 256 KiB
MAX_REQUEST_ID = 2**53  # ids travel as float64 metric values: larger ones would not compare


def request_path(metrics_dir: str) -> str:
    return os.path.join(metrics_dir, CONTROL_DIR, REQUEST_FILE)


def new_request_id() -> int:
    return time.time_ns() // 1_000_000


def write_checkpoint_request(metrics_dir: str, request_id: int | None = None,
                             at_step: int | None = None) -> CheckpointRequest:
    """Publish a request for the ranks writing into `metrics_dir` (used by the sidecar)."""
    request = CheckpointRequest(new_request_id() if request_id is None else request_id, at_step)
    os.makedirs(metrics_dir, exist_ok=True)
    fd = open_dir(os.path.join(metrics_dir, CONTROL_DIR), create=True)
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():  # a job made control/ first: the ranks would not trust it
            raise PermissionError(f"{os.path.join(metrics_dir, CONTROL_DIR)} belongs to uid "
                                  f"{owner}, not to this user")
        body = json.dumps({"id": request.id, "at_step": request.at_step}).encode()
        write_atomic(REQUEST_FILE, body, fd)
    finally:
        os.close(fd)
    return request


def read_checkpoint_request(metrics_dir: str) -> CheckpointRequest | None:
    """The current request, None when there is none; OSError or ValueError when unusable.

    Only a file written by root, by this process's user or by the folder's owner (the sidecar)
    counts: another job on the node must not make this one checkpoint.
    """
    try:
        fd = open_dir(os.path.join(metrics_dir, CONTROL_DIR), listing=False)
    except FileNotFoundError:
        return None
    try:
        owner = os.stat(REQUEST_FILE, dir_fd=fd, follow_symlinks=False).st_uid
        trusted = {0, os.geteuid(), os.stat(metrics_dir).st_uid}
        if owner not in trusted:
            raise PermissionError(f"{request_path(metrics_dir)} belongs to uid {owner}, "
                                  "neither the sidecar nor this job")
        data = json.loads(read_regular(REQUEST_FILE, MAX_REQUEST_BYTES, fd))
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    at_step = data.get("at_step")
    return CheckpointRequest(_whole(data["id"], "id"),
                             None if at_step is None else _whole(at_step, "at_step"))


def _whole(value: Any, name: str) -> int:
    """A number of the request file as the sidecar writes it, a JSON integer in [0, 2**53):
    int() would make 1.5 another request's id and raise OverflowError on 1e999."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_REQUEST_ID:
        raise ValueError(f"{name}={value!r} is not a whole number in [0, 2**53)")
    return value


# -- pod annotations (Kubernetes downward API) --------------------------------------------
_LINE = re.compile(r'^([^="\s]+)="(.*)"$', re.S)
_ESCAPE = re.compile(r'\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([0-7]{3})'
                     r'|([abfnrtv\\"\']))|(\\)|(")')
_SIMPLE = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           "\\": "\\", '"': '"', "'": "'"}


def _go_unquote(body: str) -> str:
    """The value of a Go `strconv.Quote` string (without its quotes); ValueError when invalid."""
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(body):
        out += body[pos:m.start()].encode()
        hex2, u4, u8, octal, simple, lone_backslash, lone_quote = m.groups()
        if lone_backslash or lone_quote:
            raise ValueError(f"bad escape or unescaped quote at offset {m.start()}")
        if hex2:
            out.append(int(hex2, 16))
        elif octal:
            if int(octal, 8) > 255:
                raise ValueError(f"octal escape \\{octal} out of range")
            out.append(int(octal, 8))
        elif u4 or u8:
            code = int(u4 or u8, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise ValueError(f"escape of invalid code point {code:#x}")
            out += chr(code).encode()
        else:
            out += _SIMPLE[simple].encode()
        pos = m.end()
    out += body[pos:].encode()
    return out.decode("utf-8", errors="replace")


def parse_downward_annotations(data: bytes) -> dict[str, str]:
    """Annotations from a downward API file: lines `key="value"`, values Go-quoted (the kubelet
    writes `fmt.Sprintf("%v=%q", ...)`). ValueError names the first line that is not so."""
    if len(data) > MAX_ANNOTATIONS_BYTES:
        raise ValueError(f"{len(data)} bytes, more than the {MAX_ANNOTATIONS_BYTES} a pod's "
                         "annotations can hold")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    annotations: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"line {number} is not key=\"value\": {line[:80]!r}")
        try:
            annotations[m.group(1)] = _go_unquote(m.group(2))
        except ValueError as exc:
            raise ValueError(f"line {number} ({m.group(1)[:80]}): {exc}") from None
    return annotations


def annotation_request_id(annotations: dict[str, str]) -> int | None:
    """The checkpoint request id the annotations carry, None without one; ValueError when bad."""
    raw = annotations.get(CHECKPOINT_ANNOTATION)
    if raw is None:
        return None
    request_id = decimal(raw)
    if request_id is None or not 0 < request_id < MAX_REQUEST_ID:
        raise ValueError(f"{CHECKPOINT_ANNOTATION}={raw[:40]!r} is not a request id "
                         "(a positive integer: milliseconds since the epoch)")
    return request_id


def read_annotation_request(path: str) -> CheckpointRequest | None:
    """The request in a downward API annotations file; OSError or ValueError when unusable.

    The path is the pod's own configuration (the kubelet swaps the file by a symbolic link, so
    links are followed); the content is not trusted: a FIFO is refused without blocking and at
    most MAX_ANNOTATIONS_BYTES are read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = os.read(fd, MAX_ANNOTATIONS_BYTES + 1)
    finally:
        os.close(fd)
    request_id = annotation_request_id(parse_downward_annotations(data))
    return None if request_id is None else CheckpointRequest(request_id)


class ControlChannel:
    """Collects checkpoint requests; `poll()` at step boundaries returns the newest unhandled one.

    Sources: the signal, the rank folder's control file, and (on Kubernetes) the pod's
    annotations file. A source that cannot be read is reported to `on_error(where, exc)` once per
    change of the file and skipped; the others still count.
    """

    def __init__(self, metrics_dir: str | None, signum: int | None, poll_interval: float,
                 annotations_path: str | None = None,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.metrics_dir = metrics_dir
        self.annotations_path = annotations_path
        self._on_error = on_error
        self._annotations_seen: tuple[int, int, int] | None = None
        self._annotation_request: CheckpointRequest | None = None
        self.poll_interval = poll_interval
        self.handled_id = 0
        self._signal_id = 0
        self._signum = signum
        self._previous_handler: Any = None
        self._last_poll = 0.0
        self._last_poll_annotations = 0.0
        self._last_mtime = 0
        self._file_request: CheckpointRequest | None = None
        if metrics_dir:  # a request older than this process is not for it
            existing = read_checkpoint_request_safely(metrics_dir)
            if existing is not None:
                self.handled_id = existing.id
                self._file_request = existing
        if annotations_path:  # an annotation set before a container restart was handled then
            self._poll_annotations()
            if self._annotation_request is not None:
                self.handled_id = max(self.handled_id, self._annotation_request.id)

    def install_signal(self) -> bool:
        """Install the signal handler; only possible from the main thread."""
        if self._signum is None or threading.current_thread() is not threading.main_thread():
            return False
        self._previous_handler = signal.signal(self._signum, self._on_signal)
        return True

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal_id = new_request_id()
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    def restore_signal(self) -> None:
        if self._previous_handler is not None and self._signum is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(self._signum, self._previous_handler)
            self._previous_handler = None

    def poll(self, now: float) -> CheckpointRequest | None:
        if self.metrics_dir and now - self._last_poll >= self.poll_interval:
            self._last_poll = now
            try:
                mtime = os.stat(request_path(self.metrics_dir), follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:
                mtime = 0
            if mtime and mtime != self._last_mtime:
                self._last_mtime = mtime
                self._file_request = read_checkpoint_request_safely(self.metrics_dir)
        if self.annotations_path and now - self._last_poll_annotations >= self.poll_interval:
            self._last_poll_annotations = now
            self._poll_annotations()
        candidates = [r for r in (self._file_request, self._annotation_request)
                      if r is not None and r.id > self.handled_id]
        if self._signal_id > self.handled_id:
            candidates.append(CheckpointRequest(self._signal_id))
        return max(candidates, key=lambda r: r.id) if candidates else None


    def _poll_annotations(self) -> None:
        """Re-read the annotations file when the kubelet replaced it (inode, size or mtime)."""
        path = str(self.annotations_path)
        try:
            st = os.stat(path)
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            seen = (0, 0, 0)
            if self._annotations_seen != seen:
                self._report(exc)
            self._annotations_seen = seen
            return
        if seen == self._annotations_seen:
            return
        self._annotations_seen = seen
        try:
            request = read_annotation_request(path)
        except (OSError, ValueError) as exc:
            self._report(exc)
            return
        if request is not None:
            self._annotation_request = request

    def _report(self, exc: BaseException) -> None:
        if self._on_error is not None:  # the hook counts it and logs it once
            self._on_error("control", exc)
        else:
            log.warning("ignoring unusable pod annotations %s: %s", self.annotations_path, exc)


def read_checkpoint_request_safely(metrics_dir: str) -> CheckpointRequest | None:
    try:
        return read_checkpoint_request(metrics_dir)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring unreadable checkpoint request in %s: %s", metrics_dir, exc)
        return None
