"""Who may do what in the rank folder, as file modes; the sidecar (its owner) sets them up.

- the folder and `ranks/`: mode 1733, owned by the sidecar's user. Every job may create its
  files there (write and search), none may list them, and the sticky bit stops one job from
  removing or replacing another's files; the owner (the sidecar) may remove dead ranks' files.
- `control/`: mode 0755, the sidecar's alone; ranks only read the request in it.
- `archive/`: mode 0700, the sidecar's private state.

The Slurm prolog and the systemd unit create the same layout (exporters/); `prepare` repairs it
when the sidecar finds the folder made by someone else's tool (a hostPath created 0755).
"""

from __future__ import annotations

import logging
import os
import stat

from robust_metrics.rankfolder.control import CONTROL_DIR
from robust_metrics.rankfolder.identity import RANKS_DIR
from robust_metrics.rankfolder.safeio import open_dir

__all__ = ["CONTROL_MODE", "FOLDER_MODE", "prepare"]

log = logging.getLogger(__name__)

FOLDER_MODE = 0o1733
CONTROL_MODE = 0o755


def _own(fd: int, mode: int, name: str) -> str | None:
    """Give the directory `fd` the `mode` if this user owns it; a warning when it cannot."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        return f"{name} belongs to uid {st.st_uid}, not to the sidecar's uid {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)
    return None


def prepare(directory: str) -> list[str]:
    """Create the folder, `ranks/` and `control/` with their modes; returns what is not right."""
    warnings = []
    os.makedirs(directory, exist_ok=True)
    top = open_dir(directory)
    try:
        warning = _own(top, FOLDER_MODE, directory)
        if warning:
            warnings.append(warning)
        for sub, mode in ((RANKS_DIR, FOLDER_MODE), (CONTROL_DIR, CONTROL_MODE)):
            path = os.path.join(directory, sub)
            try:
                fd = open_dir(sub, top, create=True, mode=mode)
            except OSError as exc:  # a link or a file planted in its place: not used
                warnings.append(f"{path} is not a directory of its own ({exc.strerror})")
                continue
            try:
                warning = _own(fd, mode, path)
                if warning:
                    warnings.append(warning)
            finally:
                os.close(fd)
    finally:
        os.close(top)
    for warning in warnings:
        log.warning("rank folder: %s", warning)
    return warnings

