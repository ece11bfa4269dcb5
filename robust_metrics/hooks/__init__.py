"""In-process hooks: `watch()`, step timing, loss and gradient capture, collective timing,
checkpoint control. Imported only by training processes; imports torch lazily."""

from robust_metrics.hooks.config import WatchOptions

__all__ = ["WatchOptions"]
