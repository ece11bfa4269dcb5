"""The durable action log: one SQLite database in WAL mode, the bridge's only state.

Exactly-once rests on two facts kept here. An alert instance (fingerprint + startsAt) is inserted
once under a UNIQUE key, so re-sent and grouped notifications find their row and do nothing. A step
row is committed as `running` *before* its side effect and finished after it, so a bridge killed
mid-action finds the row on restart and resumes or fails it, and never starts it a second time.

The log identifies itself: the bridge creates it with a `meta` row (`format`), and refuses to start
on a file that is not one (garbage, truncated, malformed, or emptied to 0 bytes) with
`ActionLogError`, whose one-line message names the file and how to move it aside. An emptied log
must never start silently: it has forgotten which alerts were handled, and Alertmanager's next
re-send of a handled alert would act again.

Incident statuses: pending (waiting for a worker or for its `for` guard), running, done, failed,
skipped (cooldown), cancelled (resolved before it acted), ignored (no rule matched).
Step statuses: running, success, failed, skipped, dry_run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from robust_metrics.bridge.payload import incident_key
from robust_metrics.bridge.plan import PlanStep, dump_plan, load_plan
from robust_metrics.bridge.policy import Decision, History

__all__ = ["ActionLogError", "ActionStore", "Incident", "NewAlert", "Step", "incident_key"]

LOG_FORMAT = "robust-metrics-bridge-action-log/1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    fingerprint TEXT NOT NULL,
    starts_at TEXT NOT NULL,
    run TEXT NOT NULL,
    alertname TEXT NOT NULL,
    rule TEXT,
    labels TEXT NOT NULL,
    annotations TEXT NOT NULL,
    plan TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    not_before REAL NOT NULL,
    received REAL NOT NULL,
    started REAL,
    updated REAL NOT NULL,
    notifications INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS incidents_status ON incidents(status, not_before);
CREATE INDEX IF NOT EXISTS incidents_run ON incidents(run, rule, started);
CREATE TABLE IF NOT EXISTS steps (
    incident_id INTEGER NOT NULL REFERENCES incidents(id),
    idx INTEGER NOT NULL,
    action TEXT NOT NULL,
    status TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    data TEXT NOT NULL DEFAULT '{}',
    started REAL NOT NULL,
    finished REAL,
    PRIMARY KEY (incident_id, idx)
);
CREATE INDEX IF NOT EXISTS steps_action ON steps(action, started);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class ActionLogError(RuntimeError):
    """The action log cannot be used as it is; the message is one line naming the file and what
    to do (the bridge exits with status 2 rather than start without its history)."""


def _move_aside_hint(path: str) -> str:
    return (f"if it cannot be restored from a backup, move it aside (mv {path} {path}.bad; "
            f"likewise {path}-wal and {path}-shm if present) to start a new, empty log "
            "(see 'The action log' in docs/bridge.md)")


def _create_log(path: str) -> None:
    """Write a new, complete log beside `path` and link it into place: a log file that exists
    was whole when it appeared, so one without its tables can only have been damaged since."""
    tmp = f"{path}.new-{os.getpid()}"
    db = sqlite3.connect(tmp, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(f"BEGIN; {_SCHEMA} INSERT INTO meta (key, value) "
                         f"VALUES ('format', '{LOG_FORMAT}'); COMMIT;")
    finally:
        db.close()  # the last connection: the WAL is checkpointed into the file and removed
    try:
        os.link(tmp, path)  # never replaces a log another process created meanwhile
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links
        if not os.path.exists(path):
            os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open_log(path: str) -> sqlite3.Connection:
    """Connect, check integrity and identity, create the schema; ActionLogError when unusable."""
    existed = path != ":memory:" and os.path.exists(path)
    if path != ":memory:" and not existed:
        try:
            _create_log(path)
        except (OSError, sqlite3.Error) as exc:
            raise ActionLogError(f"action log {path}: cannot create it: {exc}") from None
        existed = True
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
    except sqlite3.Error as exc:
        raise ActionLogError(f"action log {path}: cannot open it: {exc}") from None
    try:
        db.row_factory = sqlite3.Row
        # Read-only checks first: a refused file is left exactly as it was found.
        problems = [r[0] for r in db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(problems[:3]))
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if existed and "incidents" not in tables:
            raise ActionLogError(f"action log {path} holds no action log (empty or foreign "
                                 "file; the bridge writes a header into every log it creates): "
                                 "its history is gone, and re-sent alerts would act again; "
                                 + _move_aside_hint(path))
        if "meta" in tables:
            row = db.execute("SELECT value FROM meta WHERE key='format'").fetchone()
            if row is None or row[0] != LOG_FORMAT:
                raise ActionLogError(f"action log {path} has format {row and row[0]!r}, not "
                                     f"{LOG_FORMAT!r}; " + _move_aside_hint(path))
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a committed step row survives power loss
        db.execute("PRAGMA foreign_keys=ON")
        db.executescript(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('format', ?)", (LOG_FORMAT,))
    except ActionLogError:
        db.close()
        raise
    except sqlite3.OperationalError as exc:
        db.close()
        if "locked" in str(exc):
            raise ActionLogError(f"action log {path} is locked by another process (is another "
                                 f"bridge using it?): {exc}") from None
        raise ActionLogError(f"action log {path} is unusable ({exc}); "
                             + _move_aside_hint(path)) from None
    except sqlite3.DatabaseError as exc:
        db.close()
        raise ActionLogError(f"action log {path} is corrupt ({exc}); "
                             + _move_aside_hint(path)) from None
    return db

def _recorded_step(data: str) -> float | None:
    """The highest step a restart step recorded before it restarted (None: not known)."""
    try:
        value = json.loads(data).get("highest_step")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


FINAL_INCIDENT = ("done", "failed", "skipped", "cancelled", "ignored")


@dataclass(frozen=True)
class NewAlert:
    """A firing alert as the webhook accepted it, with the rule chosen for it (or none)."""

    fingerprint: str
    starts_at: str
    run: str
    alertname: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    rule: str | None
    plan: list[PlanStep]  # given in its stored form (JSON objects), it is read into steps
    not_before: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", load_plan(self.plan))

    @property
    def key(self) -> str:
        return incident_key(self.fingerprint, self.starts_at)


@dataclass(frozen=True)
class Step:
    incident_id: int
    idx: int
    action: str
    status: str
    detail: str
    data: dict[str, Any]
    started: float
    finished: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"idx": self.idx, "action": self.action, "status": self.status,
                "detail": self.detail, "data": self.data, "started": self.started,
                "finished": self.finished}


@dataclass(frozen=True)
class Incident:
    id: int
    key: str
    fingerprint: str
    starts_at: str
    run: str
    alertname: str
    rule: str | None
    labels: dict[str, str]
    annotations: dict[str, str]
    plan: list[PlanStep]  # given in its stored form (JSON objects), it is read into steps
    status: str
    reason: str
    not_before: float
    received: float
    started: float | None
    updated: float
    notifications: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", load_plan(self.plan))

    def to_dict(self, steps: Iterable[Step] = ()) -> dict[str, Any]:
        return {"id": self.id, "key": self.key, "fingerprint": self.fingerprint,
                "starts_at": self.starts_at, "run": self.run, "alertname": self.alertname,
                "rule": self.rule, "labels": self.labels, "status": self.status,
                "reason": self.reason, "received": self.received, "started": self.started,
                "updated": self.updated, "notifications": self.notifications,
                "steps": [s.to_dict() for s in steps]}


def _incident(row: sqlite3.Row) -> Incident:
    return Incident(
        row["id"], row["key"], row["fingerprint"], row["starts_at"], row["run"],
        row["alertname"], row["rule"], json.loads(row["labels"]), json.loads(row["annotations"]),
        load_plan(json.loads(row["plan"])), row["status"], row["reason"], row["not_before"],
        row["received"], row["started"], row["updated"], row["notifications"])


def _step(row: sqlite3.Row) -> Step:
    return Step(row["incident_id"], row["idx"], row["action"], row["status"], row["detail"],
                json.loads(row["data"]), row["started"], row["finished"])


class _Write:
    """One webhook's writes, waiting for the group commit that carries them."""

    def __init__(self, fn: Callable[[sqlite3.Connection], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class ActionStore:
    """Thread-safe access to the action log (one connection, one lock: writes serialise anyway).

    Webhook writes go through a group commit: concurrent requests share one transaction and one
    fsync (each in its own savepoint, so one bad request fails alone). With `synchronous=FULL` an
    fsync costs milliseconds, and 20 webhooks in flight would otherwise queue behind 20 of them.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._db = _open_log(path)
        self._writes: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="bridge-store-writer",
                                        daemon=True)
        self._writer.start()

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(10)
        with self._lock:
            self._db.close()

    def _write_loop(self) -> None:
        while True:
            first = self._writes.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while True:  # everything queued meanwhile rides in the same commit
                try:
                    more = self._writes.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                with self._tx() as db:
                    for w in batch:
                        db.execute("SAVEPOINT write")
                        try:
                            w.result = w.fn(db)
                            db.execute("RELEASE write")
                        except Exception as exc:
                            db.execute("ROLLBACK TO write")
                            db.execute("RELEASE write")
                            w.error = exc
            except BaseException as exc:  # the commit itself failed: nobody's write landed
                for w in batch:
                    w.error = exc
            for w in batch:
                w.done.set()
            if stop:
                return

    def _group_write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        write = _Write(fn)
        self._writes.put(write)
        write.done.wait()
        if write.error is not None:
            raise write.error
        return write.result

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One immediate transaction on the log, for modules that keep their own tables in it
        (the incident ledger)."""
        return self._tx()

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """The log as it stands, for reads only and without a transaction of its own, so it can
        be used inside a decision (`claim` calls `decide` in its transaction, where
        `transaction()` would nest)."""
        with self._lock:
            yield self._db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ------------------------------------------------------------------ webhook side
    def accept(self, alerts: Iterable[NewAlert], now: float | None = None) -> list[bool]:
        """Record firing alerts; True for each that is new, False for a re-sent one."""
        now = time.time() if now is None else now
        alerts = list(alerts)
        return list(self._group_write(lambda db: self._accept(db, alerts, now)))

    @staticmethod
    def _accept(db: sqlite3.Connection, alerts: list[NewAlert], now: float) -> list[bool]:
        out: list[bool] = []
        for a in alerts:
            status = "pending" if a.rule is not None else "ignored"
            reason = "" if a.rule is not None else "no rule matched"
            cur = db.execute(
                "INSERT INTO incidents (key, fingerprint, starts_at, run, alertname, rule, "
                "labels, annotations, plan, status, reason, not_before, received, updated) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(key) DO NOTHING",
                (a.key, a.fingerprint, a.starts_at, a.run, a.alertname, a.rule,
                 json.dumps(dict(a.labels), sort_keys=True),
                 json.dumps(dict(a.annotations), sort_keys=True), json.dumps(dump_plan(a.plan)),
                 status, reason, a.not_before, now, now))
            if cur.rowcount == 0:
                db.execute("UPDATE incidents SET notifications = notifications + 1 "
                           "WHERE key = ?", (a.key,))
            out.append(cur.rowcount == 1)
        return out

    def resolve(self, keys: Iterable[tuple[str, str, str, str]], now: float | None = None) -> int:
        """Resolved alerts (fingerprint, startsAt, run, alertname): cancel what has not started.

        An instance never seen firing gets a `cancelled` row too, so a firing notification that
        arrives late, after its resolution, still never acts. Returns how many were cancelled.
        """
        now = time.time() if now is None else now
        keys = list(keys)
        return int(self._group_write(lambda db: self._resolve(db, keys, now)))

    @staticmethod
    def _resolve(db: sqlite3.Connection, keys: list[tuple[str, str, str, str]],
                 now: float) -> int:
        cancelled = 0
        for fingerprint, starts_at, run, alertname in keys:
            key = incident_key(fingerprint, starts_at)
            cur = db.execute(
                "UPDATE incidents SET status='cancelled', reason='resolved before it acted', "
                "updated=? WHERE key=? AND status='pending'", (now, key))
            cancelled += cur.rowcount
            db.execute(
                "INSERT INTO incidents (key, fingerprint, starts_at, run, alertname, rule, "
                "labels, annotations, plan, status, reason, not_before, received, updated) "
                "VALUES (?,?,?,?,?,NULL,'{}','{}','[]','cancelled',"
                "'resolved before it was seen firing',0,?,?) ON CONFLICT(key) DO NOTHING",
                (key, fingerprint, starts_at, run, alertname, now, now))
        return cancelled

    # ------------------------------------------------------------------ worker side
    def recover(self, resumable: Mapping[str, Callable[[Step], bool]],
                now: float | None = None) -> list[str]:
        """After a crash: settle steps left `running` and requeue their incidents.

        `resumable(step) -> bool` says whether a step may continue (its side effect can be
        checked or is safe to finish); the others are marked failed, never repeated.
        Returns one line per step touched, for the log.
        """
        now = time.time() if now is None else now
        notes: list[str] = []
        with self._tx() as db:
            rows = db.execute("SELECT * FROM steps WHERE status='running'").fetchall()
            for row in rows:
                step = _step(row)
                check = resumable.get(step.action)
                if check is not None and check(step):
                    notes.append(f"incident {step.incident_id} step {step.idx} ({step.action}): "
                                 "resumed after a bridge restart")
                    continue
                db.execute(
                    "UPDATE steps SET status='failed', finished=?, detail=? "
                    "WHERE incident_id=? AND idx=?",
                    (now, "interrupted by a bridge restart; outcome unknown, not repeated",
                     step.incident_id, step.idx))
                notes.append(f"incident {step.incident_id} step {step.idx} ({step.action}): "
                             "marked failed (interrupted, not repeated)")
            db.execute("UPDATE incidents SET status='pending', updated=? WHERE status='running'",
                       (now,))
        return notes

    def claim(self, decide: Callable[[Incident, History, float], Decision],
              horizon_s: float, now: float | None = None,
              ) -> tuple[Incident, Decision] | None:
        """Take the oldest due incident whose run has nothing else running (actions per run are
        serial: two restarts of one job must not race), decide it and persist the decision, in
        one transaction: no other worker can act on the run between reading its history and
        recording what it does.

        `decide(incident, history, now)` is the policy (`policy.decide`); `history` is what the
        log holds about the incident's run within `horizon_s`. Returns the incident as
        persisted and the decision (`run`: it is now running; `skip`, `ignore`: closed;
        `wait`: still pending, later), or None when nothing is due. An incident a previous
        bridge process had started is resumed with its recorded plan, not decided again.
        """
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute(
                "SELECT * FROM incidents i WHERE status='pending' AND not_before <= ? AND NOT "
                "EXISTS (SELECT 1 FROM incidents j WHERE j.run = i.run AND j.status='running') "
                "ORDER BY not_before, id LIMIT 1", (now,)).fetchone()
            if row is None:
                return None
            incident = _incident(row)
            if incident.started is not None:  # resumed after a restart of the bridge
                db.execute("UPDATE incidents SET status='running', updated=? WHERE id=?",
                           (now, incident.id))
                return (dataclasses.replace(incident, status="running"),
                        Decision("run", incident.rule, incident.plan, incident.not_before,
                                 "resumed"))
            decision = decide(incident, self._history(db, incident, now - horizon_s), now)
            return dataclasses.replace(incident, **self._persist(db, incident, decision, now)), \
                decision

    @staticmethod
    def _history(db: sqlite3.Connection, incident: Incident, since: float) -> History:
        last = {r["rule"]: (int(r["id"]), float(r["started"])) for r in db.execute(
            "SELECT rule, id, MAX(started) AS started FROM incidents WHERE run=? AND id != ? "
            "AND rule IS NOT NULL AND started >= ? GROUP BY rule",
            (incident.run, incident.id, since))}
        rows = db.execute(
            "SELECT s.started, s.data FROM steps s JOIN incidents i ON i.id = s.incident_id "
            "WHERE i.run=? AND s.action='restart' AND s.started >= ? AND s.status != 'skipped' "
            "ORDER BY s.started", (incident.run, since)).fetchall()
        return History(last, tuple(float(r[0]) for r in rows),
                       tuple(_recorded_step(r[1]) for r in rows))

    @staticmethod
    def _persist(db: sqlite3.Connection, incident: Incident, decision: Decision,
                 now: float) -> dict[str, Any]:
        """Write a decision on a pending incident; returns the fields that changed."""
        plan = json.dumps(dump_plan(decision.plan))
        if decision.verdict == "run":
            db.execute("UPDATE incidents SET status='running', started=?, updated=?, rule=?, "
                       "plan=? WHERE id=?", (now, now, decision.rule, plan, incident.id))
            return {"status": "running", "started": now, "rule": decision.rule,
                    "plan": decision.plan}
        if decision.verdict == "wait":
            db.execute("UPDATE incidents SET not_before=?, updated=? WHERE id=?",
                       (decision.not_before, now, incident.id))
            return {"not_before": decision.not_before}
        status = "skipped" if decision.verdict == "skip" else "ignored"
        db.execute("UPDATE incidents SET status=?, reason=?, updated=?, rule=?, plan=? "
                   "WHERE id=?", (status, decision.reason, now, decision.rule, plan, incident.id))
        return {"status": status, "reason": decision.reason, "rule": decision.rule,
                "plan": decision.plan}

    def next_due(self) -> float | None:
        with self._lock:
            row = self._db.execute(
                "SELECT MIN(not_before) FROM incidents WHERE status='pending'").fetchone()
        return None if row[0] is None else float(row[0])

    def finish_incident(self, incident_id: int, status: str, reason: str = "",
                        now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._tx() as db:
            db.execute("UPDATE incidents SET status=?, reason=?, updated=? WHERE id=?",
                       (status, reason, now, incident_id))

    def start_step(self, incident_id: int, idx: int, action: str, now: float | None = None) -> None:
        """Commit the step as running before its side effect (the crash-safety point)."""
        now = time.time() if now is None else now
        with self._tx() as db:
            db.execute("INSERT INTO steps (incident_id, idx, action, status, started) "
                       "VALUES (?,?,?,'running',?)", (incident_id, idx, action, now))

    def save_step_data(self, incident_id: int, idx: int, data: Mapping[str, Any]) -> None:
        with self._tx() as db:
            db.execute("UPDATE steps SET data=? WHERE incident_id=? AND idx=?",
                       (json.dumps(dict(data), default=str), incident_id, idx))

    def finish_step(self, incident_id: int, idx: int, status: str, detail: str,
                    data: Mapping[str, Any] | None = None, now: float | None = None,
                    incident_status: str | None = None, incident_reason: str = "") -> None:
        """Record a step's outcome (and, when given, the incident's, in the same commit)."""
        now = time.time() if now is None else now
        with self._tx() as db:
            if incident_status is not None:
                db.execute("UPDATE incidents SET status=?, reason=?, updated=? WHERE id=?",
                           (incident_status, incident_reason, now, incident_id))
            if data is None:
                db.execute("UPDATE steps SET status=?, detail=?, finished=? "
                           "WHERE incident_id=? AND idx=?", (status, detail, now, incident_id, idx))
            else:
                db.execute("UPDATE steps SET status=?, detail=?, finished=?, data=? "
                           "WHERE incident_id=? AND idx=?",
                           (status, detail, now, json.dumps(dict(data), default=str),
                            incident_id, idx))

    # ------------------------------------------------------------------ reading
    def steps(self, incident_id: int) -> list[Step]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM steps WHERE incident_id=? ORDER BY idx",
                                    (incident_id,)).fetchall()
        return [_step(r) for r in rows]

    def get(self, incident_id: int) -> Incident | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM incidents WHERE id=?",
                                   (incident_id,)).fetchone()
        return None if row is None else _incident(row)

    def list(self, run: str | None = None, status: str | None = None, limit: int = 100,
             include_ignored: bool = False) -> list[tuple[Incident, list[Step]]]:
        """The audit trail, newest first."""
        where, args = [], []
        if run is not None:
            where.append("run = ?")
            args.append(run)
        if status is not None:
            where.append("status = ?")
            args.append(status)
        elif not include_ignored:
            where.append("status != 'ignored'")
        sql = "SELECT * FROM incidents" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY id DESC LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit)).fetchall()
            incidents = [_incident(r) for r in rows]
            if not incidents:
                return []
            marks = ",".join("?" * len(incidents))
            step_rows = self._db.execute(
                f"SELECT * FROM steps WHERE incident_id IN ({marks}) ORDER BY incident_id, idx",
                [i.id for i in incidents]).fetchall()
        by_id: dict[int, list[Step]] = {}
        for r in step_rows:
            by_id.setdefault(r["incident_id"], []).append(_step(r))
        return [(i, by_id.get(i.id, [])) for i in incidents]
