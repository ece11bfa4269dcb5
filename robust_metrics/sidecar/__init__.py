"""The node sidecar: one exporter per node that says what a rank cannot.

Run it as `robust-metrics sidecar --dir $ROBUST_METRICS_DIR` (see docs/sidecar.md). Layout:

- `config.py`: settings, loopback by default; `cli.py`: the command line.
- `collectors/`: one collector per file (`ranks`, `process`, `nvml`, `nic`, `nccl_ras`,
  `selftest`), each registering itself in `collectors/registry.py`: the one-method `Collector`
  interface and the registry that makes `--collector.NAME` flags and times each collector.
- `rank_files/`: the ranks' folder as the sidecar keeps it, with no HTTP in it: scanning within
  bounds, merging, liveness and reaping, the archive of dead processes; the folder's formats
  belong to `robust_metrics.rankfolder`.
- `auth.py`: bearer token, basic auth and TLS; `app.py`: the routes.

Nothing here imports torch: the sidecar runs where training does not.
"""

__all__: list[str] = []
