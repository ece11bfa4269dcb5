"""`process`: what only an outside observer can say about a rank process.

A rank stuck in a collective cannot report that it is stuck, and a rank killed with SIGKILL cannot
report that it died; the sidecar can. Per rank (the newest process of each `run`/`rank` pair in
`ranks/<pid>.json`):

- whether the process is alive, and whether it is stopped (state `T`, SIGSTOP) or traced (`t`);
- whether it ended normally: the hook writes `finished` into its identity file at `close()` or at
  interpreter exit without an uncaught exception; a rank ended by SIGTERM, SIGINT or SIGHUP (a
  launcher stopping the survivors of a failure, a scheduler cancelling the job, a restart) was
  stopped on request and counts as ended too; any other exit (SIGKILL, OOM kill, segfault, an
  exception) is a crash;
- when it exited (labelled with its pid), so that the first rank to die can be told from the
  peers that die of its death a moment later: the time the hook wrote when an uncaught
  exception ended it; else, for a rank that kept writing its files until it died, its last
  write (at most one write interval before its death, and so before any peer's exception: the
  kernel reports a killed process's exit only after it has closed its sockets and its peers
  may have seen them close, and on a loaded node a peer can stamp its exception first);
  else the kernel's own time of the exit from its process events where the sidecar may
  subscribe (`proc_connector`), else noticed at once through a pidfd (Linux 5.3+) rather than
  at the next scrape. The time is fixed when first published. The signal that ended it comes
  from the process events too, else from the zombie before its parent reaps it;
- the global step it had reached when it exited, the step it started from and when it last
  stepped, from its last files (`RankFiles` keeps them): the proof that a restart which failed
  again before any scrape saw it alive trained, and from where;
- its CPU time and resident memory;
- the seconds since its last completed step (or since `watch()` before its first step), as of
  the rank's last write of its files while it keeps writing them (every `flush_interval`, from a
  thread that also writes while the training thread waits in a collective), so the age of a job
  whose steps are shorter than the write interval does not include the wait for the next write;
  once the writes stop (a stopped process), counted on the sidecar's clock, so the age of a hung
  rank keeps growing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Iterator

import psutil
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from robust_metrics import schema
from robust_metrics.rankfolder.identity import RankIdentity
from robust_metrics.sidecar.collectors.node_summaries import (
    PROCESS_SUMMARIES,
    RankValue,
    summarise,
)
from robust_metrics.sidecar.collectors.registry import register_collector
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.proc_connector import ProcExits, signal_of
from robust_metrics.sidecar.rank_files import RankFiles

__all__ = ["ExitWatcher", "ProcessCollector", "exit_time", "newest_per_rank", "step_age"]

log = logging.getLogger(__name__)
LABELS = ["run", "rank"]
_STOPPED = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
_REQUESTED_STOP = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}
_EXIT_CODE_FIELD = 49  # /proc/<pid>/stat field 52 (exit_code), counted after the command name


def exit_signal(pid: int) -> int | None:
    """The signal that ended `pid`, read from its zombie's /proc/<pid>/stat (Linux 3.5+) before
    its parent reaps it; 0 for a plain exit, None once it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rfind(b")") + 2:].split()
        if fields[0] not in (b"Z", b"X"):
            return None
        return signal_of(int(fields[_EXIT_CODE_FIELD]))  # the field is the wait status
    except (OSError, IndexError, ValueError):
        return None


def newest_per_rank(identities: dict[int, RankIdentity]) -> dict[tuple[str, str], RankIdentity]:
    """The latest process of each (run, rank): a restarted rank replaces its dead predecessor."""
    newest: dict[tuple[str, str], RankIdentity] = {}
    for ident in identities.values():
        key = (ident.run, ident.rank)
        known = newest.get(key)
        if known is None or (ident.started or 0.0, ident.pid) > (known.started or 0.0, known.pid):
            newest[key] = ident
    return newest


class ExitWatcher:
    """Exit times of watched processes, taken when the kernel reports the exit (pidfd + poll).

    One daemon thread waits on every watched pidfd; a process is watched from the first scrape that
    sees it alive. Where pidfds are unavailable (not Linux, old kernel, no permission) the exit time
    is the first scrape that finds the process gone.
    """

    def __init__(self, events: bool = True) -> None:
        self._events_wanted = events
        self._events: ProcExits | None = None
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # fd -> pid
        self._pids: set[int] = set()
        self._exited: dict[int, float] = {}
        self._signals: dict[int, int] = {}  # pid -> signal that ended it, when it was seen
        self._poll = select.poll() if hasattr(select, "poll") else None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        if self._poll is not None:
            self._poll.register(self._wake_r, select.POLLIN)
        self._thread: threading.Thread | None = None
        self._stop = False

    def watch(self, pid: int) -> None:
        """Start watching `pid` (a no-op when it is watched already or pidfds are unavailable)."""
        if self._poll is None or not hasattr(os, "pidfd_open"):
            return
        with self._lock:
            if pid in self._pids or pid in self._exited:
                return
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                return
            self._pids.add(pid)
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
            if self._thread is None:
                self._events = ProcExits.open() if self._events_wanted else None
                if self._events is not None:
                    self._poll.register(self._events.fileno(), select.POLLIN)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="robust-metrics-exits")
                self._thread.start()
        os.write(self._wake_w, b"x")  # re-poll with the new fd

    def exited(self, pid: int, now: float) -> float:
        """When `pid` exited: the kernel's report, else `now` (remembered for later scrapes).
        Queued process events are read first, as in `stopped_on_request`."""
        self._record_events(from_poll=False)
        with self._lock:
            return self._exited.setdefault(pid, now)

    def stopped_on_request(self, pid: int) -> bool:
        """Whether `pid` was ended by SIGTERM, SIGINT or SIGHUP (seen at its exit). Queued
        process events are read first: a scrape may find the rank gone before this watcher's
        thread has woken up to its exit."""
        self._record_events(from_poll=False)
        with self._lock:
            return self._signals.get(pid) in _REQUESTED_STOP

    def forget(self, keep: set[int]) -> None:
        """Drop the exit times of processes the folder no longer lists (bounded memory)."""
        with self._lock:
            for pid in set(self._exited) - keep:
                del self._exited[pid]
                self._signals.pop(pid, None)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        assert self._poll is not None
        while not self._stop:
            try:
                events = self._poll.poll(1000)
            except OSError as exc:  # never expected; the fallback exit time still works
                log.warning("exit watcher stopped: %s", exc)
                return
            now = time.time()
            # The events first: the kernel queues an exit's event, with its time, before the
            # exit's pidfd wakes this thread, whose `now` may come later on a loaded node.
            events_fd = self._events.fileno() if self._events is not None else None
            if events_fd is not None and events:
                self._record_events()
            for fd, _ in events:
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    continue
                if fd == events_fd:
                    continue
                with self._lock:
                    pid = self._fds.pop(fd, None)
                    self._poll.unregister(fd)
                    os.close(fd)
                    if pid is not None:
                        self._pids.discard(pid)
                        self._exited.setdefault(pid, now)
                        sig = exit_signal(pid)  # the zombie lives until its parent reaps it
                        if sig is not None:
                            self._signals.setdefault(pid, sig)
        if self._events is not None:
            self._events.close()

    def _record_events(self, from_poll: bool = True) -> None:
        """Record the exit signals and times queued on the connector. The kernel queues a
        process's exit event before its pidfd or its parent's waitpid can report the exit, so
        whoever sees a rank gone finds its signal and time here. Read under the lock, so that a
        second reader never returns while the first holds an event it has not recorded yet."""
        with self._lock:
            events = self._events
            if events is None:
                return
            try:
                exits = events.read()
            except OSError as exc:
                if from_poll:  # the poll thread owns the poll set: it falls back
                    log.warning("process events unreadable, falling back to zombies: %s", exc)
                    assert self._poll is not None
                    self._poll.unregister(events.fileno())
                    events.close()
                    self._events = None
                return
            for tgid, status, at in exits:
                if tgid in self._pids or tgid in self._exited:
                    self._signals[tgid] = signal_of(status)
                    self._exited.setdefault(tgid, at)


WRITES_STALE_AFTER = 1.0
"""Seconds without a write after which a rank's files are stale (at least; 3 write intervals for a
hook that writes less often): its step age then counts on the sidecar's clock."""


def _fresh(written: float | None, since: float, now: float,
           flush_interval: float | None) -> float | None:
    """`written` when that write is within [since, now] (the folder is the job's: other times
    are ignored) and no staler than the writes' interval allows at `now`; else None."""
    stale_after = max(WRITES_STALE_AFTER, 3 * (flush_interval or 0.0))
    if written is not None and since <= written <= now and now - written <= stale_after:
        return written
    return None


def step_age(now: float, since: float, written: float | None,
             flush_interval: float | None = None) -> float:
    """Seconds since `since` (the last step): as of the last write `written` while the files are
    fresh, else as of `now`."""
    fresh = _fresh(written, since, now, flush_interval)
    return fresh - since if fresh is not None else max(0.0, now - since)


def exit_time(seen: float, ident: RankIdentity, written: float | None = None) -> float:
    """When the rank exited, given the exit the sidecar saw (`seen`) and the rank's last write of
    its files (`written`): the time it wrote that an exception ended it (`parse_identity` keeps
    only a time after its start) when no later than `seen`; else its last write when it kept
    writing until `seen`; else `seen`. The rank's own times order a crash before the exits of
    the peers that die of it, however late the sidecar saw it."""
    crashed = ident.crashed
    if crashed is not None and crashed <= seen:
        return crashed
    fresh = _fresh(written, ident.started or 0.0, seen, ident.flush_interval)
    return fresh if fresh is not None else seen


class ProcessCollector:
    def __init__(self, folder: RankFiles, exits: ExitWatcher | None = None,
                 node: str = "") -> None:
        self.folder = folder
        self.node = node  # the node label of its per-node summaries
        self.exits = exits if exits is not None else ExitWatcher()
        self._exit_times: dict[int, float] = {}  # pid -> as first published

    def _exit_time(self, ident: RankIdentity, written: float | None, now: float) -> float:
        """The exit time as first published: the rank's files, whose last write may date it,
        are merged away later."""
        if ident.pid not in self._exit_times:
            seen = self.exits.exited(ident.pid, now)
            self._exit_times[ident.pid] = exit_time(seen, ident, written)
        return self._exit_times[ident.pid]

    def collect(self) -> Iterator[Metric]:
        s = schema
        snapshot = self.folder.snapshot()

        def gauge(spec: schema.MetricSpec) -> GaugeMetricFamily:
            return GaugeMetricFamily(spec.name, spec.help, labels=LABELS)

        alive_f, stopped_f = gauge(s.RANK_PROCESS_ALIVE), gauge(s.RANK_PROCESS_STOPPED)
        finished_f = gauge(s.RANK_FINISHED)
        exit_f = GaugeMetricFamily(s.RANK_EXIT_TIMESTAMP.name, s.RANK_EXIT_TIMESTAMP.help,
                                   labels=[*LABELS, "pid"])
        exit_step_f, exit_start_f = gauge(s.RANK_EXIT_GLOBAL_STEP), gauge(s.RANK_EXIT_START_STEP)
        exit_last_f = gauge(s.RANK_EXIT_LAST_STEP_TIMESTAMP)
        cpu_f = CounterMetricFamily(s.RANK_PROCESS_CPU.name, s.RANK_PROCESS_CPU.help,
                                    labels=LABELS)
        rss_f, age_f = gauge(s.RANK_PROCESS_RSS), gauge(s.RANK_STEP_AGE)
        now = time.time()
        self.exits.forget(set(snapshot.identities))
        for pid in set(self._exit_times) - set(snapshot.identities):
            del self._exit_times[pid]
        for (run, rank), ident in sorted(newest_per_rank(snapshot.identities).items()):
            labels = [run, rank]
            alive = snapshot.alive.get(ident.pid, False)
            times = rss = status = None
            if alive:  # the snapshot may be a quarter second old: ask again
                try:
                    proc = psutil.Process(ident.pid)
                    with proc.oneshot():
                        status = proc.status()
                        times = proc.cpu_times()
                        rss = proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    alive = False
                except psutil.AccessDenied:
                    pass
            alive_f.add_metric(labels, 1.0 if alive else 0.0)
            if ident.finished or (not alive and self.exits.stopped_on_request(ident.pid)):
                finished_f.add_metric(labels, 1.0)  # present only when true: no healthy series
            if not alive:
                exit_f.add_metric([*labels, str(ident.pid)],
                                  self._exit_time(ident, snapshot.written.get(ident.pid), now))
                final = snapshot.final.get(ident.pid)
                if final is not None:
                    exit_step_f.add_metric(labels, final.step)
                    if final.start_step is not None:
                        exit_start_f.add_metric(labels, final.start_step)
                    if final.last_step_at is not None:
                        exit_last_f.add_metric(labels, final.last_step_at)
                continue
            self.exits.watch(ident.pid)
            if status in _STOPPED:
                stopped_f.add_metric(labels, 1.0)
            if times is not None:
                cpu_f.add_metric(labels, times.user + times.system)
                rss_f.add_metric(labels, float(rss))
            last = snapshot.last_step.get((run, rank))
            since = last if last else ident.started
            if since and not ident.finished:  # a rank shutting down after close() is no hang
                written = snapshot.written.get(ident.pid)
                age_f.add_metric(labels, step_age(now, since, written, ident.flush_interval))
        yield from (alive_f, stopped_f, finished_f, exit_f, exit_step_f, exit_start_f,
                    exit_last_f, cpu_f, rss_f, age_f)
        per_rank = [RankValue(sample.labels["run"], sample.labels["rank"], sample.name, "",
                              sample.value)
                    for family in (alive_f, age_f) for sample in family.samples]
        yield from summarise(per_rank, self.node, {}, PROCESS_SUMMARIES)


@register_collector("process", default_enabled=True,
                    help="rank process liveness, stop and exit, CPU, memory and step age")
def _factory(config: SidecarConfig, folder: RankFiles) -> ProcessCollector:
    return ProcessCollector(folder, node=config.node)
