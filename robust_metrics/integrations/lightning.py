"""PyTorch Lightning callback: `Trainer(callbacks=[RobustMetricsCallback()])`.

It calls `watch()` once the optimizer exists (fit start) and closes it at teardown; everything
else is the hook's. Validation runs in the `eval` phase, so hang alerts stay silent during it.
The checkpoint callback, when none is given, saves through `trainer.save_checkpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

import robust_metrics

__all__ = ["RobustMetricsCallback"]


class RobustMetricsCallback(pl.Callback):
    """Start and stop robust-metrics with the fit; `watch_options` go to `watch()`."""

    def __init__(self, checkpoint_dir: str | None = None,
                 checkpoint: Callable[[int], Any] | None = None, **watch_options: Any) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint = checkpoint
        self.watch_options = watch_options
        self.handle: Any = None
        self._eval: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        checkpoint = self.checkpoint
        if checkpoint is None and self.checkpoint_dir:
            directory = self.checkpoint_dir

            def checkpoint(step: int) -> None:
                trainer.save_checkpoint(os.path.join(directory, f"step-{step}.ckpt"))

        options = {"rank": trainer.global_rank, "world_size": trainer.world_size,
                   "local_rank": trainer.local_rank, "start_step": trainer.global_step,
                   **self.watch_options}
        self.handle = robust_metrics.watch(pl_module, optimizer, checkpoint=checkpoint, **options)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.handle is not None:
            self._eval = self.handle.phase("eval")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._eval is not None:
            self._eval.restore()
            self._eval = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
