"""Writing the store to its sink: at every step end, or every `flush_interval` seconds from a
background thread, which keeps a hung rank's multiprocess files current."""

from __future__ import annotations

import threading

from robust_metrics.hooks.guard import ErrorHandler
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink, NullSink, Sink

__all__ = ["Flusher"]


class Flusher:
    """Owns the sink once `start(sink)` gives it one, and every write to it."""

    def __init__(self, store: MetricStore, interval: float, on_error: ErrorHandler) -> None:
        self.store = store
        self.interval = interval
        self.on_error = on_error
        self.sink: Sink = NullSink()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def flush(self, force: bool = False) -> None:
        """Write the store to the sink: at once when forced or with no flush interval; otherwise
        the flusher thread writes it every `flush_interval` seconds."""
        if not force and self._thread is not None:
            return
        with self._lock:
            try:
                self.sink.flush(self.store)
            except Exception as exc:
                self.on_error("flush", exc)

    def start(self, sink: Sink) -> None:
        """Write everything to `sink` now, then keep it current."""
        self.sink = sink
        self.flush(force=True)
        if self.interval > 0 and isinstance(sink, MultiprocessSink):
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="robust-metrics-flush")
            self._thread.start()

    def _loop(self) -> None:
        """Keep the files current while the training thread is blocked (a hang) or busy."""
        while not self._stop.wait(self.interval):
            self.flush(force=True)

    def close(self) -> None:
        """Stop the thread and release the sink (its last write included)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            with self._lock:
                self.sink.close(self.store)
        except Exception as exc:
            self.on_error("sink", exc)
