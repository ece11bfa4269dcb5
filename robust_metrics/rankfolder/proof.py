"""Whether a pid named in the rank folder really is a rank writing that folder.

Anyone who can write the folder can write `ranks/<pid>.json` naming any pid, for example a
process of another user that holds a secret in a local variable. Before the sidecar dumps a
process's stack (with locals) or acts on it, it proves the claim from the kernel's point of view:

1. the process runs as the user who owns `ranks/<pid>.json`, and
2. the process holds open one of the folder's metric files named for its pid and owned by that
   user: the hook keeps its `<type>_<pid>.db` files open for its whole life, a process that is not
   a rank of this folder does not.

Reading `/proc/<pid>/fd` needs the same rights as dumping the process, so a sidecar that could dump
can also prove; one that cannot prove refuses.
"""

from __future__ import annotations

import os

from robust_metrics.rankfolder.identity import RankIdentity
from robust_metrics.rankfolder.metricfile import parse_name

__all__ = ["prove_rank"]


def _own_files(directory: str, pid: int, uid: int) -> set[tuple[int, int]]:
    """(device, inode) of the folder's regular metric files named for `pid` and owned by `uid`."""
    found = set()
    with os.scandir(directory) as it:
        for entry in it:
            db = parse_name(directory, entry.name)
            if db is None or db.pid != pid or not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            if st.st_uid == uid:
                found.add((st.st_dev, st.st_ino))
    return found


def _holds_open(pid: int, files: set[tuple[int, int]]) -> bool:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if (st.st_dev, st.st_ino) in files:
            return True
    return False


def prove_rank(directory: str, identity: RankIdentity) -> str | None:
    """None when `identity.pid` is proven a rank writing `directory`, else why it is not."""
    pid = identity.pid
    try:
        proc_uid = os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return f"no such process {pid}"
    except OSError as exc:
        return f"cannot inspect pid {pid}: {exc.strerror or exc}"
    if identity.uid is None or proc_uid != identity.uid:
        return (f"pid {pid} runs as uid {proc_uid} but its identity file belongs to uid "
                f"{identity.uid}: not proven a rank, not touched")
    try:
        files = _own_files(directory, pid, proc_uid)
        if not files:
            return f"pid {pid} has no metric files of its own in the folder: not proven a rank"
        if not _holds_open(pid, files):
            return (f"pid {pid} does not hold this folder's metric files open: not proven a "
                    "rank, not touched")
    except OSError as exc:
        return f"cannot check the open files of pid {pid}: {exc.strerror or exc}"
    return None
