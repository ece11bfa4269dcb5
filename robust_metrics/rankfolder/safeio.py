"""File access inside a rank folder that a hostile job cannot turn against its reader or writer.

Anyone who can run a job on a node can write into the rank folder, so every name in it may be a
symbolic link to someone else's file, a FIFO that blocks `open()` forever, or a sparse file of
gigabytes. Every open here therefore uses `O_NOFOLLOW` (a link is refused, never followed),
`O_NONBLOCK` (a FIFO or device opens at once and is then refused as not a regular file), checks
`S_ISREG` on the open descriptor (no race between check and use) and reads at most a given number
of bytes. Sub-folders are opened as directory descriptors with `O_NOFOLLOW`, and files are opened
relative to them, so a link planted in place of `ranks/` or `archive/` is refused too.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading

__all__ = [
    "NotRegular",
    "TooLarge",
    "open_dir",
    "open_regular",
    "read_regular",
    "write_atomic",
]

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegular(OSError):
    """A name that is a FIFO, socket, device or directory where a regular file belongs."""


class TooLarge(OSError):
    """A file larger than its reader allows; the reader refuses it instead of reading it all."""


def open_dir(path: str, dir_fd: int | None = None, *, create: bool = False,
             mode: int = 0o755, listing: bool = True) -> int:
    """A descriptor of the directory `path` (relative to `dir_fd` if given), refusing a link.

    With `listing=False` the descriptor (O_PATH) can only serve as `dir_fd` for opening, renaming
    and removing names in it, which needs no read permission: ranks write into folders of mode
    1733 that they may not list. Raises OSError (ELOOP or ENOTDIR) for a link or anything that
    is not a directory.
    """
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode, dir_fd=dir_fd)
    return os.open(path, _DIR_FLAGS if listing else _PATH_FLAGS, dir_fd=dir_fd)


def open_regular(path: str, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file `path`; never follows a link, never blocks."""
    fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, max_bytes: int, dir_fd: int | None = None) -> bytes:
    """The whole regular file at `path`, refused (TooLarge) when it is longer than `max_bytes`."""
    fd = open_regular(path, dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise TooLarge(f"{path}: {size} bytes, more than the {max_bytes} allowed")
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:  # grew after fstat
            raise TooLarge(f"{path}: more than the {max_bytes} bytes allowed")
        return data
    finally:
        os.close(fd)


def write_atomic(name: str, data: bytes, dir_fd: int, mode: int = 0o644) -> None:
    """Replace `name` in the directory `dir_fd` with `data`, atomically.

    The temporary file is created with `O_EXCL | O_NOFOLLOW` under a name unique to this process
    and thread, so a link planted at a temporary name fails the write instead of redirecting it;
    `rename()` then replaces `name` itself, never what a link at `name` points to.
    """
    tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # whatever the umask: the sidecar reads it without DAC_OVERRIDE
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp, dir_fd)
        raise
    os.close(fd)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _unlink_quietly(tmp, dir_fd)
        raise


def _unlink_quietly(name: str, dir_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)
