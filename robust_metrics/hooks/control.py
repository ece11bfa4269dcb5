"""Checkpoint requests and phases: what the job is doing, and what it was asked to do.

A checkpoint requested by signal, by the rank folder's control file or by the pod's annotations
(`robust_metrics.rankfolder.control.ControlChannel`) runs the user's callback at the next step
boundary, in the `checkpoint` phase, with its duration, time and failures published. The phase
(`train`, `eval`, `checkpoint`) is one gauge per phase: hang and slowness alerts stay silent
outside `train`, so evaluation and checkpointing never look like a stuck job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from robust_metrics import schema
from robust_metrics.hooks.config import WatchOptions
from robust_metrics.hooks.guard import ErrorHandler, guard
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.patches import Patches
from robust_metrics.rankfolder.control import ControlChannel

__all__ = ["Control"]

log = logging.getLogger("robust_metrics")


class Control:
    """The control channel's requests, the checkpoint callback and the phase gauges.

    `flush(force=True)` writes the store out: each phase change is published at once.
    """

    def __init__(self, store: MetricStore, options: WatchOptions,
                 flush: Callable[..., None], on_error: ErrorHandler) -> None:
        self.options = options
        self.on_error = on_error
        self._flush = flush
        self.channel = ControlChannel(
            options.metrics_dir, options.checkpoint_signal if options.checkpoint else None,
            options.control_poll_interval,
            annotations_path=options.pod_annotations if options.checkpoint else None,
            on_error=on_error)
        self._patches = Patches()
        st = store
        self._ckpt_request = st.series(schema.CHECKPOINT_REQUEST_ID)
        self._ckpt_ts = st.series(schema.LAST_CHECKPOINT_TIMESTAMP)
        self._ckpt_duration = st.series(schema.CHECKPOINT_DURATION)
        self._ckpt_failures = st.series(schema.CHECKPOINT_FAILURES)
        self._phases = {p: st.series(schema.PHASE, phase=p) for p in schema.PHASES}
        self._last_step_ts = st.series(schema.LAST_STEP_TIMESTAMP)  # the steps' own series
        self.phase = "train"
        self.set_phase("train")

    def install(self) -> None:
        if self.channel.install_signal():
            self._patches.add(self.channel.restore_signal)

    def restore(self) -> None:
        self._patches.restore()

    # -- checkpoints -----------------------------------------------------------------------
    @guard("control")
    def check(self, now: float, step: int) -> None:
        """At a step boundary: run the checkpoint of a pending request due by `step`."""
        if self.options.checkpoint is None:
            return
        request = self.channel.poll(now)
        if request is None or (request.at_step is not None and step < request.at_step):
            return
        self.channel.handled_id = request.id
        self.checkpoint(step, request_id=request.id)

    def checkpoint(self, step: int, request_id: int | None = None) -> bool:
        """Run the checkpoint callback now for global step `step`, in the checkpoint phase; True
        when it succeeded."""
        fn = self.options.checkpoint
        if fn is None:
            raise RuntimeError("watch() was given no checkpoint= callback")
        previous = self.phase
        self.set_phase("checkpoint")
        self._flush(force=True)
        started = time.perf_counter()
        ok = False
        try:
            fn(step)
            ok = True
        except Exception as exc:
            self._ckpt_failures.inc()
            log.exception("robust-metrics: checkpoint callback failed at step %d: %s", step, exc)
        finally:
            if ok:
                self._ckpt_duration.set(time.perf_counter() - started)
                self._ckpt_ts.set(time.time())
            if request_id is not None:
                self._ckpt_request.set(request_id)
            self.set_phase(previous)
            self._flush(force=True)
        return ok

    # -- phases ----------------------------------------------------------------------------
    def set_phase(self, name: str) -> None:
        if name == "train" and self.phase != "train":
            # Progress resumes now: the fresh timestamp is written before the phase flips, so no
            # scrape sees `train` with the age of the last step before the phase (a false hang).
            self._last_step_ts.set(time.time())
        self.phase = name
        for phase, series in self._phases.items():
            series.set(1.0 if phase == name else 0.0)
