"""robust-metrics: observability for large PyTorch training jobs on Prometheus and Grafana.

In training code, one line after the model and optimizer exist::

    import robust_metrics
    handle = robust_metrics.watch(model, optimizer, checkpoint=save_checkpoint)

The sidecar (`robust-metrics sidecar`), the action bridge (`robust-metrics bridge`) and the analysis
tools never import torch; this package imports it only when `watch()` is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from robust_metrics.hooks.watch import Watch

__all__ = ["__version__", "watch"]
__version__ = "0.1.0"


def watch(model: Any = None, optimizer: Any = None, **options: Any) -> Watch:
    """Instrument a training loop; see `robust_metrics.hooks.watch.watch` for the options."""
    from robust_metrics.hooks.watch import watch as _watch

    return _watch(model, optimizer, **options)
