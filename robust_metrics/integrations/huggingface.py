"""Hugging Face Trainer callback: `Trainer(..., callbacks=[RobustMetricsCallback()])`.

It calls `watch()` when training begins (the Trainer has built its optimizer by then) and closes
it when training ends. Evaluation runs in the `eval` phase. With Accelerate, the loss is the one
given to `accelerator.backward(loss)`, before it divides it by the accumulation steps (the Trainer
divides it itself before: with N accumulation steps the published loss is 1/N of the step's).
Under DDP the callback watches the wrapper the Trainer built (see `_wrapper_of`).
"""

from __future__ import annotations

import gc
from typing import Any

from transformers import TrainerCallback

import robust_metrics

__all__ = ["RobustMetricsCallback"]


class RobustMetricsCallback(TrainerCallback):  # type: ignore[misc]
    """Start and stop robust-metrics with `Trainer.train()`; `watch_options` go to `watch()`."""

    def __init__(self, **watch_options: Any) -> None:
        self.watch_options = watch_options
        self.handle: Any = None
        self._eval: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        options = {"rank": args.process_index, "world_size": args.world_size,
                   "local_rank": max(args.local_process_index, 0),
                   "start_step": state.global_step, **self.watch_options}
        self.handle = robust_metrics.watch(_wrapper_of(model), optimizer, **options)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.handle is not None:  # evaluation is over: back to training
            self.handle.phase("train")

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.handle is not None and self.handle.control.phase != "eval":
            self.handle.phase("eval")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def _wrapper_of(model: Any) -> Any:
    """The DistributedDataParallel the Trainer wrapped `model` in (its `model_wrapped`), else
    `model`. Callbacks are handed the inner module, and DDP's gradient reduction is timed only
    through its wrapper: watching the inner module would count the wait for a slower rank's
    gradients as compute. The wrapper holds the module in its `_modules` dict, itself in the
    wrapper's `__dict__`, so it is found by walking up the model's referrers through dicts, once,
    when training begins. FSDP2 shards the module in place: it is the model."""
    if model is None:
        return model
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return model
    level = [model]
    for _ in range(3):  # the model, `_modules`, the wrapper's `__dict__`
        holders = [h for obj in level for h in gc.get_referrers(obj)]
        for holder in holders:
            if isinstance(holder, DistributedDataParallel) and holder.module is model:
                return holder
        level = [h for h in holders if isinstance(h, dict)]
    return model
