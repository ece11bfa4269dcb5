"""What one read of the ranks' folder yields: the value every collector of a scrape shares."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from robust_metrics.rankfolder.identity import RankIdentity

__all__ = ["FinalProgress", "Labels", "Snapshot"]

Labels = tuple[tuple[str, str], ...]
"""A sample's labels, in the order its metric file holds them."""


@dataclass(frozen=True)
class FinalProgress:
    """What a dead process's gauge files said last: the step it reached, the step it started
    from and when it last stepped. A process that crashed before any scrape saw it alive leaves
    only this as proof that it trained, and from where."""

    step: float | None = None
    start_step: float | None = None
    last_step_at: float | None = None


@dataclass
class Snapshot:
    """Everything one scrape needs from the folder, read once and shared by the collectors."""

    taken: float
    families: list[Metric]
    identities: dict[int, RankIdentity]
    alive: dict[int, bool]
    last_step: dict[tuple[str, str], float]
    corrupt_total: int
    errors: list[str] = field(default_factory=list)
    final: dict[int, FinalProgress] = field(default_factory=dict)  # pid -> progress at its exit
    written: dict[int, float] = field(default_factory=dict)  # pid -> last write of its files
