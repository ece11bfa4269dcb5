"""`ranks`: the metrics the rank processes on this node publish through the multiprocess folder.

All the work (dead processes, the archive, corrupt files) is in `robust_metrics.sidecar.rank_files`;
this collector only serves its snapshot (but the windows that only the node's summaries read:
`node_summaries.SUMMARISED_ONLY`) and the count of corrupt files.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.sidecar.collectors.node_summaries import SUMMARISED_ONLY
from robust_metrics.sidecar.collectors.registry import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = ["RanksCollector"]


class RanksCollector:
    def __init__(self, folder: RankFiles) -> None:
        self.folder = folder

    def collect(self) -> Iterator[Metric]:
        snapshot = self.folder.snapshot()
        for family in snapshot.families:
            yield _served(family)
        spec = schema.CORRUPT_FILES
        yield CounterMetricFamily(spec.name, spec.help, value=snapshot.corrupt_total)


_UNSERVED_WINDOWS: dict[str, frozenset[str]] = {
    metric: frozenset(w for m, w in SUMMARISED_ONLY if m == metric)
    for metric, _ in SUMMARISED_ONLY}


def _served(family: Metric) -> Metric:
    """The family without the windows that only the node's summaries read (SUMMARISED_ONLY)."""
    windows = _UNSERVED_WINDOWS.get(family.name)
    if windows is None:
        return family
    served = Metric(family.name, family.documentation, family.type)
    served.samples = [s for s in family.samples if s.labels.get("window") not in windows]
    return served


@register_collector("ranks", default_enabled=True,
                    help="rank metrics from the multiprocess folder (--dir)")
def _factory(config: SidecarConfig, folder: RankFiles) -> RanksCollector:
    return RanksCollector(folder)
