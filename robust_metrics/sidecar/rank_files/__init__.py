"""The ranks' multiprocess folder as the sidecar keeps it: live values, dead processes, an archive.

Each rank process writes prometheus_client multiprocess files named by its pid plus
`ranks/<pid>.json` (who it is). A rank that crashes and restarts gets a new pid and new files, so a
plain `MultiProcessCollector` would keep serving the dead pid's gauges (a stale `robust_rank_info`
with the old pid, an old `robust_loss`) forever, and deleting the files would make counters drop.
`RankFiles` does what Prometheus needs instead, split as prometheus_client splits
`MultiProcessCollector.merge` from `mark_process_dead`:

- `scan.py`: listing the folder and reading its files within bounds (no links followed, no FIFO
  opened, each file and each scrape's reading capped, corrupt files skipped and counted);
- `merge.py`: the processes' samples merged into families, as `MultiProcessCollector.merge` does;
- `liveness.py`: which pids run; a dead one's gauges vanish at once, its progress is kept, its
  identity reaped;
- `archive.py`: a dead pid's counters, summaries and histograms added into `archive/` once its
  files are quiet, then the files deleted, and the archive of a finished run dropped;
- `reader.py`: `RankFiles`, one read in that order, cached and pinned for a scrape;
- `snapshot.py`: `Snapshot`, what a read gives every collector of a scrape.

The folder's formats belong to `robust_metrics.rankfolder`; nothing here knows HTTP.
"""

from robust_metrics.sidecar.rank_files.liveness import process_alive
from robust_metrics.sidecar.rank_files.reader import RankFiles
from robust_metrics.sidecar.rank_files.scan import MAX_SCRAPE_BYTES
from robust_metrics.sidecar.rank_files.snapshot import FinalProgress, Snapshot

__all__ = ["MAX_SCRAPE_BYTES", "FinalProgress", "RankFiles", "Snapshot", "process_alive"]
