"""The rank folder: the contract between a training rank and its node, writer and reader alike.

A rank's hook writes into `ROBUST_METRICS_DIR`; the node sidecar, `robust-metrics stacks
--metrics-dir` and (through the sidecar) the bridge read it. Layout::

    <dir>/counter_<pid>.db, gauge_mostrecent_<pid>.db, summary_<pid>.db, ...   metricfile.py
    <dir>/ranks/<pid>.json       who the process is (run, rank, node, topology)    identity.py
    <dir>/control/checkpoint.json  a checkpoint request for the ranks             control.py
    <dir>/archive/               the sidecar's own state (sidecar/rank_files/archive.py)

On Kubernetes a checkpoint request can also arrive as a pod annotation projected into a file
outside the folder (downward API); control.py owns that format too, writer's name and reader.

The folder is written by jobs and therefore untrusted by everyone who reads it: every access
goes through `safeio` (no links followed, no blocking on FIFOs, bounded reads), and `proof` says
whether a pid really is a rank writing this folder before anything acts on it. Nothing here
imports torch or the hook package, so the sidecar and the bridge can use it.
"""

from robust_metrics.rankfolder.control import (
    CheckpointRequest,
    ControlChannel,
    read_checkpoint_request,
    request_path,
    write_checkpoint_request,
)
from robust_metrics.rankfolder.identity import (
    RankIdentity,
    rank_info,
    read_identities,
    write_identity,
)
from robust_metrics.rankfolder.metricfile import (
    CorruptFile,
    DbFile,
    Entry,
    MetricFile,
    file_name,
    metric_key,
    parse_key,
    parse_name,
    read_entries,
)

__all__ = [
    "CheckpointRequest",
    "ControlChannel",
    "CorruptFile",
    "DbFile",
    "Entry",
    "MetricFile",
    "RankIdentity",
    "file_name",
    "metric_key",
    "parse_key",
    "parse_name",
    "rank_info",
    "read_checkpoint_request",
    "read_entries",
    "read_identities",
    "request_path",
    "write_checkpoint_request",
    "write_identity",
]
