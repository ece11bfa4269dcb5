"""One collector per module, and their registry (`registry.py`), as in node_exporter's `collector/`.

Each collector module registers itself on import with `registry.register_collector`; importing
this package imports them all, and Python imports it before any of its modules, so whoever uses
the registry finds every collector in it. The registry imports no collector: nothing here imports
in a circle.
"""

from robust_metrics.sidecar.collectors import (
    nccl_ras,
    nic,
    node_summaries,
    nvml,
    process,
    ranks,
    selftest,
)

__all__ = ["nccl_ras", "nic", "node_summaries", "nvml", "process", "ranks", "selftest"]
