"""`watch(model, optimizer)`: the one line that instruments a PyTorch training loop.

`Watch` is the life cycle: it reads what it was given (`parallelism.py`), builds the parts,
installs them, and at its close undoes every patch and hook and publishes the last values. The
parts, each installed and restored by the watch:
- `steps.py`: step boundaries from the optimizer's step post-hook, data wait from the model's
  forward pre-hook, the GradScaler's skipped steps, GC pauses from `gc.callbacks`;
- `numerics.py`: the loss from the 0-dim tensor `backward()` runs on, the gradient norm from
  `clip_grad_norm_` or the optimizer's pre-step hook, read without synchronising the GPU;
- `control.py`: checkpoint requests and phases;
- `flusher.py`: the writes to the sink, and the thread that keeps them current;
- `collectives/`: one interception path per way collectives are issued, all reporting to one
  `CollectiveTracker`;
- `trace.py`: sampled op traces for `robust-metrics whatif`.
Every hook body is guarded (`guard.py`): an exception inside robust-metrics is counted in
`robust_hook_errors_total{where}`, logged once, and never reaches the training loop.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from robust_metrics import schema
from robust_metrics.hooks import frameworks, parallelism
from robust_metrics.hooks.collectives import CollectiveTracker, Interception
from robust_metrics.hooks.config import WatchOptions
from robust_metrics.hooks.control import Control
from robust_metrics.hooks.flusher import Flusher
from robust_metrics.hooks.guard import HookErrors, guard
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.numerics import LossAccumulator, Numerics
from robust_metrics.hooks.patches import Patches
from robust_metrics.hooks.sinks import MultiprocessSink, NullSink, Sink, make_sink
from robust_metrics.hooks.steps import StepHooks, unwrap_optimizer
from robust_metrics.rankfolder.identity import write_identity

__all__ = ["Watch", "watch"]

_active: Watch | None = None
_active_lock = threading.Lock()


class Watch:
    """Handle returned by `watch()`. Use as a context manager, or call `close()` at the end."""

    def __init__(self, model: Any, optimizer: Any, options: WatchOptions) -> None:
        self.parallelism = parallelism.resolve(model)
        # Topology the user gave wins; the rest comes from the DeviceMesh or pipeline stage.
        options.topology = {**self.parallelism.topology, **options.topology}
        self.options = options
        self.model = model
        self.modules = self.parallelism.modules
        self.optimizer = optimizer
        self.store = MetricStore({"run": options.run, "rank": str(options.rank)})
        self.on_error = HookErrors(self.store)
        self._closed = False
        self._started = time.time()
        self._patches = Patches()  # every part's restore, undone newest first at close
        self.tracker = CollectiveTracker(self.on_error)
        self.flusher = Flusher(self.store, options.flush_interval, self.on_error)
        # Series are created in this order, which every sink writes them in: the step's
        # timestamp before the phase, so no scrape sees `train` beside a stale timestamp.
        StepHooks.create_series(self.store)
        self.numerics = Numerics(self.store, options, self.on_error)
        self.control = Control(self.store, options, self.flusher.flush, self.on_error)
        self.steps = StepHooks(self.store, options, self.tracker,
                               end_numerics=self.numerics.end_step,
                               check_control=self.control.check, flush=self.flusher.flush,
                               grad_norm=self.numerics.set_grad_norm, on_error=self.on_error)
        self._bind_rank_series()
        sink = self._open_sink()
        self._install()
        self.flusher.start(sink)
        atexit.register(self._close_at_exit)

    # -- set-up ----------------------------------------------------------------------------
    def _bind_rank_series(self) -> None:
        s, st, o = schema, self.store, self.options
        info = {"local_rank": str(o.local_rank), "world_size": str(o.world_size), "node": o.node,
                "pid": str(os.getpid())}
        for key in ("dp_rank", "pp_rank", "tp_rank"):
            info[key] = str(o.topology[key]) if key in o.topology else ""
        st.series(s.RANK_INFO, **info).set(1)
        st.on_read(self._refresh)
        self._cuda = self._cuda_device()
        if self._cuda is not None:
            self._cuda_series = [st.series(m) for m in (s.CUDA_ALLOCATED, s.CUDA_RESERVED,
                                                        s.CUDA_PEAK)]

    def _open_sink(self) -> Sink:
        o = self.options
        try:
            sink = make_sink(o.backend, self.store, directory=o.metrics_dir, port=o.port)
        except ValueError:
            raise
        except Exception as exc:  # a full disk or a taken port must not stop training
            self.on_error("sink", exc)
            return NullSink()
        if isinstance(sink, MultiprocessSink):
            self._write_identity()
            sink.on_reopen = self._write_identity
        return sink

    @guard("identity")
    def _write_identity(self, finished: float | None = None,
                        crashed: float | None = None) -> None:
        """`ranks/<pid>.json` lets the sidecar map processes to ranks for liveness and stacks;
        `finished` (written by a normal close) tells it that the exit to come is not a crash;
        `crashed` (written when an exception ends the rank) when it failed, on the rank's clock,
        so the first rank to fail is told from the peers that fail of it even when no scrape
        saw them alive."""
        o = self.options
        write_identity(str(o.metrics_dir), run=o.run, rank=o.rank, local_rank=o.local_rank,
                       node=o.node, world_size=o.world_size, topology=o.topology,
                       started=self._started, finished=finished, crashed=crashed,
                       flush_interval=o.flush_interval or None)

    def _cuda_device(self) -> Any:
        with contextlib.suppress(Exception):
            params = list(self.modules[0].parameters()) if self.modules else []
            if params and params[0].is_cuda:
                return params[0].device
        return None

    def _install(self) -> None:
        o = self.options
        optimizer = unwrap_optimizer(self.optimizer) if self.optimizer is not None else None
        if frameworks.steps_itself(self.optimizer):  # the norm comes with its step
            optimizer = None
        self._patches.add(self.numerics.restore)
        self.numerics.install(optimizer, self.model)
        self._patches.add(self.steps.restore)
        self.steps.install(self.optimizer, self.modules)
        if o.collectives:
            self._install_collectives()
        if o.trace_every:  # sampled op traces for `robust-metrics whatif`; nothing when off
            self._install_trace()
        self._patches.add(self.control.restore)
        self.control.install()

    def _install_path(self, path: Interception) -> None:
        self._patches.add(path.restore)
        path.install(self.tracker)

    @guard("collectives")
    def _install_collectives(self) -> None:
        import torch.distributed as dist

        from robust_metrics.hooks.collectives import (
            coalesced,
            ddp,
            distributed,
            funcol,
            streams,
            work,
        )
        from robust_metrics.hooks.timing import StepTimer, source_for

        tracker = self.tracker
        tracker.timer = StepTimer(source_for(self._cuda))  # CUDA events on GPU models
        self._patches.add(tracker.close)  # last at close: wrappers kept elsewhere step aside
        for path in (distributed.DistributedCalls(), coalesced.CoalescedCalls(),
                     work.WorkWait(), funcol.FunctionalCollectives()):
            self._install_path(path)
        if not tracker.timer.source.host:  # where the step's stream waits for FSDP2's
            self._install_path(streams.CudaStreams())
        if not (dist.is_available() and dist.is_initialized()):
            return
        tracker.watch_group(None)  # the default group; others on their first collective
        model = ddp.find_ddp(self.modules)
        if model is not None:  # DDP keeps its C++ all-reduce: timed from two points per step
            reducer = ddp.DdpReducer(model, self.on_error)
            self._install_path(reducer)
            self.steps.ddp_probe = reducer.probe

    @guard("trace")
    def _install_trace(self) -> None:
        from robust_metrics.hooks.trace import TraceRecorder

        o, tracker, steps = self.options, self.tracker, self.steps
        recorder = TraceRecorder(
            trace_dir=str(o.trace_dir), every=o.trace_every, steps=o.trace_steps, rank=o.rank,
            topology=o.topology, on_error=self.on_error, current_step=lambda: steps.global_step,
            source=tracker.timer.source, ddp_window=lambda: tracker.timer.last_window)
        for undo in recorder.install(self.modules, self.optimizer):
            self._patches.add(undo)
        tracker.on_span = recorder.add_collective

    # -- public API ------------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """The global step: the start step plus the optimizer steps taken since."""
        return self.steps.global_step

    @property
    def sink(self) -> Sink:
        return self.flusher.sink

    def loss(self, value: Any) -> None:
        """Publish this micro-step's loss explicitly (wins over the loss captured from backward)."""
        try:
            self.numerics.losses.add(value, source=LossAccumulator.EXPLICIT)
        except Exception as exc:
            self.on_error("loss", exc)

    def phase(self, name: str) -> _PhaseScope:
        """Enter phase `name` (train, eval, checkpoint). As a context manager, restore on exit.

        Hang and slowness alerts stay silent outside `train`, so evaluation and checkpointing
        never look like a stuck job.
        """
        if name not in schema.PHASES:
            raise ValueError(f"phase {name!r}: choose one of {', '.join(schema.PHASES)}")
        previous = self.control.phase
        self._enter_phase(name)
        return _PhaseScope(self._enter_phase, previous)

    def _enter_phase(self, name: str) -> None:
        if name == "train" and self.control.phase != "train":
            self.steps.resume()
        self.control.set_phase(name)
        self.flusher.flush(force=True)

    def checkpoint(self, request_id: int | None = None) -> bool:
        """Run the checkpoint callback now, in the checkpoint phase; True when it succeeded."""
        return self.control.checkpoint(self.steps.global_step, request_id)

    def set_step(self, step: int) -> None:
        """Tell the hook the global step after resuming from a checkpoint."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be an integer >= 0")
        self.steps.set_step(step)

    def close(self) -> None:
        """Remove every hook and patch, publish the last values and that this rank finished
        normally (its exit is then no crash), release the sink."""
        self._close(finished=True)

    def _close_at_exit(self) -> None:
        """At interpreter exit without close(): finished unless an exception ended the program
        (the interpreter keeps it in sys.last_value before running exit handlers)."""
        crashed = getattr(sys, "last_value", None) is not None
        self._close(finished=not crashed)

    def _close(self, finished: bool) -> None:
        global _active
        if self._closed:
            return
        self._closed = True
        self.steps.closed = self.numerics.closed = True
        ended = time.time()
        with contextlib.suppress(Exception):
            atexit.unregister(self._close_at_exit)
        self._patches.restore()
        self.numerics.reader.poll()
        self.flusher.close()
        if self.options.backend == "multiprocess" and not isinstance(self.sink, NullSink):
            if finished:
                self._write_identity(finished=time.time())
            else:
                self._write_identity(crashed=ended)
        with _active_lock:
            if _active is self:
                _active = None

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # An exception leaving the `with` block is a crash, not a normal end.
        self._close(finished=exc_type is None)

    # -- read at each scrape or flush ------------------------------------------------------
    @guard("refresh")
    def _refresh(self) -> None:
        self.tracker.publish(self.store)
        if self._cuda is not None:
            self._update_cuda()

    def _update_cuda(self) -> None:
        import torch

        values = (torch.cuda.memory_allocated(self._cuda), torch.cuda.memory_reserved(self._cuda),
                  torch.cuda.max_memory_allocated(self._cuda))
        for series, value in zip(self._cuda_series, values, strict=True):
            series.set(float(value))


class _PhaseScope:
    """What `phase()` returns: already in the phase; leaving a `with` block (or calling
    `restore()`) goes back to the phase before."""

    def __init__(self, enter: Callable[[str], None], previous: str) -> None:
        self._enter = enter
        self._previous = previous

    def restore(self) -> None:
        self._enter(self._previous)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.restore()


def watch(model: Any = None, optimizer: Any = None, **options: Any) -> Watch:
    """Instrument a training loop with one line, after the model and optimizer exist.

    Options (all optional; the environment fills the rest):
      run: job identity label (default: SLURM_JOB_ID, TORCHELASTIC_RUN_ID, ... or 'local');
      rank, local_rank, world_size, node: default from RANK/LOCAL_RANK/WORLD_SIZE/SLURM_* env;
      backend: 'auto' (multiprocess if ROBUST_METRICS_DIR is set, else http), 'multiprocess',
        'http', 'otel' or 'null';
      metrics_dir: multiprocess folder (default ROBUST_METRICS_DIR);
      port: in-process /metrics port (default ROBUST_METRICS_PORT or 9750, plus local rank);
      topology: {'dp_rank': .., 'pp_rank': .., 'tp_rank': ..} for robust_rank_info;
      checkpoint: fn(step) run at the next step boundary after a request (SIGUSR1 or sidecar);
      checkpoint_signal: the signal that requests a checkpoint (default SIGUSR1, None for none);
      pod_annotations: on Kubernetes, the downward API file of the pod's annotations (default
        ROBUST_METRICS_POD_ANNOTATIONS); a new `robust-metrics.io/checkpoint-request` id there
        requests a checkpoint (docs/schedulers.md);
      start_step: global step when resuming (or call handle.set_step(n));
      grad_norm: compute the gradient norm when clip_grad_norm_ is not called (default True);
      collectives: time torch.distributed collectives and DDP's gradient reduction, the
        compute/blocked split (default True; robust_metrics.hooks.timing);
      gc_pauses: time Python GC pauses (default True);
      flush_interval: seconds between writes of the multiprocess files by a background thread,
        so a hung rank's files stay current (default 0.25; 0 writes at every step end).
      trace_dir, trace_every, trace_steps: record trace_steps steps out of every trace_every
        (0: off) as what-if op traces in trace_dir (robust_metrics.hooks.trace, docs/whatif.md);
      flops_per_step: the model FLOPs this rank computes in one optimizer step (for a dense
        transformer about 6 x parameters x tokens of this rank's batch, its share under tensor
        or pipeline parallelism), or a callable taking no argument that returns them at each step
        (variable sequence lengths). It must be a Python number: a tensor would need a device
        synchronisation and is counted as a hook error. Publishes robust_model_flops_total, from
        which alert_rules/mfu.yml computes achieved FLOP/s and MFU (default None: no series).
      batch_position: a callable taking no argument that returns where this step's batch is
        in the data (a sample offset, a shard and index folded into one int), called once per
        step; at the first non-finite value the hook publishes it as
        robust_nonfinite_first_batch beside robust_nonfinite_first_step, so the bad batch can
        be found (default None: not called);
      time_scale: the time scale of the rules that judge this job (`robust-metrics rules
        --time-scale`), which scales the step windows the hook keeps for them (1m, 2m, 5m;
        robust_metrics.hooks.windows). Default ROBUST_METRICS_TIME_SCALE or 1: production.

    Raises TypeError or ValueError for bad options; nothing raised later reaches the training loop.
    """
    global _active
    resolved = WatchOptions.resolve(**options)
    with _active_lock:
        if _active is not None and not _active._closed:
            raise RuntimeError("robust_metrics.watch() is already active in this process; "
                               "close() the first handle before watching again")
        _active = Watch(model, optimizer, resolved)
        return _active
