"""How each process on the node ended, from the kernel's process events connector.

The sidecar tells a rank stopped on request (SIGTERM, SIGINT, SIGHUP: a restart, a cancel, a
launcher tearing down the survivors of a failure) from a crash by the signal that ended it. The
zombie's `/proc/<pid>/stat` holds that signal only until the parent reaps it, and launchers reap
within a millisecond (torchrun polls its workers at 0.5 ms while it stops them), so reading it
loses the race now and then. The connector (netlink, `NETLINK_CONNECTOR`, `CN_IDX_PROC`)
reports every exit with its wait status as it happens, whoever reaps, stamped with the kernel's
monotonic clock at the exit: the time a rank died, however late the sidecar gets to read it (on
a loaded node, later than a peer that dies of that death writes its own). It needs
CAP_NET_ADMIN and the host's network namespace (a sidecar run as root by systemd, or a DaemonSet
pod with `hostNetwork: true` and that capability); where it is refused, `open()` returns None
and the sidecar reads zombies instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
import time
from typing import NamedTuple

__all__ = ["ProcExit", "ProcExits", "signal_of"]

log = logging.getLogger(__name__)

_NETLINK_CONNECTOR = 11
_CN_IDX_PROC = 1
_CN_VAL_PROC = 1
_NLMSG_DONE = 3
_PROC_CN_MCAST_LISTEN = 1
_PROC_EVENT_EXIT = 0x80000000
_NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HDR = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT_EVENT = struct.Struct("=IIII")  # pid, tgid, exit_code (wait status), exit_signal


class ProcExit(NamedTuple):
    """A process that ended: its pid (thread-group id), wait status, and when, in seconds since
    the epoch (the kernel's monotonic stamp moved onto the wall clock)."""

    tgid: int
    status: int
    at: float


class ProcExits:
    """A subscribed connector socket; `read()` returns the processes that ended."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def open(cls) -> ProcExits | None:
        """Subscribe to process events, or None where the kernel or the sidecar's rights refuse."""
        if not hasattr(socket, "AF_NETLINK"):
            return None
        sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.bind((0, _CN_IDX_PROC))
            op = struct.pack("=I", _PROC_CN_MCAST_LISTEN)
            body = _CN_MSG.pack(_CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(op), 0) + op
            sock.send(_NLMSG_HDR.pack(_NLMSG_HDR.size + len(body), _NLMSG_DONE, 0, 0, 0) + body)
            sock.setblocking(False)
        except OSError as exc:
            if sock is not None:
                sock.close()
            log.info("process events connector unavailable (%s): exit signals are read from "
                     "zombies, which a fast reaper can hide", exc)
            return None
        return cls(sock)

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list[ProcExit]:
        """Every exit of a whole process queued on the socket."""
        exits: list[ProcExit] = []
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return exits
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # events were dropped: zombies are the fallback
                    log.warning("process events connector overran; some exit signals were lost")
                    continue
                raise
            wall, mono = time.time(), time.monotonic_ns()
            exits.extend(ProcExit(tgid, status, min(wall, wall - (mono - stamp) / 1e9))
                         for tgid, status, stamp in _exits_in(data))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _exits_in(data: bytes) -> list[tuple[int, int, int]]:
    """(tgid, wait status, monotonic ns) of the process exits in one datagram (threads' exits
    left out)."""
    exits: list[tuple[int, int, int]] = []
    offset = 0
    while offset + _NLMSG_HDR.size <= len(data):
        length = _NLMSG_HDR.unpack_from(data, offset)[0]
        if length < _NLMSG_HDR.size:
            break
        event = offset + _NLMSG_HDR.size + _CN_MSG.size
        if event + _EVENT_HDR.size + _EXIT_EVENT.size <= offset + length:
            what, _, stamp = _EVENT_HDR.unpack_from(data, event)
            if what == _PROC_EVENT_EXIT:
                pid, tgid, status, _ = _EXIT_EVENT.unpack_from(data, event + _EVENT_HDR.size)
                if pid == tgid:
                    exits.append((tgid, status, stamp))
        offset += (length + 3) & ~3
    return exits


def signal_of(status: int) -> int:
    """The signal in a wait status (0 for a plain exit), from an event or a zombie's stat."""
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
