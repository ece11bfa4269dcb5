"""RankFiles against files written by the hook's real multiprocess sink, with liveness injected."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from robust_metrics import schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink
from robust_metrics.rankfolder.identity import pid_of
from robust_metrics.rankfolder.metricfile import CorruptFile, parse_name, read_entries
from robust_metrics.sidecar.collectors.registry import ScrapeRegistry
from robust_metrics.sidecar.rank_files import RankFiles


class FakeRank:
    """One rank 'process' writing with the real sink under a chosen pid."""

    def __init__(self, directory: Path, pid: int, rank: int = 0, run: str = "r1",
                 started: float | None = None) -> None:
        self.pid = pid
        self.store = MetricStore({"run": run, "rank": str(rank)})
        self.sink = MultiprocessSink(str(directory), pid=pid)
        self.steps = self.store.series(schema.STEPS_TOTAL)
        self.loss = self.store.series(schema.LOSS)
        self.duration = self.store.series(schema.STEP_DURATION)
        self.store.series(schema.RANK_INFO, pid=str(pid), node="n", local_rank=str(rank),
                          world_size="2").set(1)
        (directory / "ranks").mkdir(exist_ok=True)
        (directory / "ranks" / f"{pid}.json").write_text(json.dumps(
            {"run": run, "rank": rank, "pid": pid, "started": started or time.time()}))

    def step(self, n: int = 1, loss: float = 1.0) -> None:
        for _ in range(n):
            self.steps.inc()
            self.duration.observe(0.5)
        self.loss.set(loss)
        self.sink.flush(self.store)

    def close(self) -> None:
        self.sink.close(self.store)


def values(folder: RankFiles, name: str) -> dict[tuple, float]:
    folder._snapshot = None  # no cache between the steps of a test
    out = {}
    for family in folder.snapshot().families:
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(folder: RankFiles, name: str) -> float:
    return sum(values(folder, name).values())


@pytest.fixture
def live() -> set[int]:
    return set()


def make_folder(directory: Path, live: set[int], **kwargs: float) -> RankFiles:
    kwargs.setdefault("merge_after", 0.0)
    return RankFiles(str(directory), alive=lambda pid, started: pid in live, cache_seconds=0,
                      **kwargs)


def test_live_ranks_are_merged_like_prometheus_client(tmp_path: Path, live: set[int]) -> None:
    a, b = FakeRank(tmp_path, 101, rank=0), FakeRank(tmp_path, 102, rank=1)
    live |= {101, 102}
    a.step(3, loss=0.5)
    b.step(2, loss=0.7)
    folder = make_folder(tmp_path, live)
    steps = values(folder, "robust_steps_total")
    assert steps == {(("rank", "0"), ("run", "r1")): 3.0, (("rank", "1"), ("run", "r1")): 2.0}
    assert values(folder, "robust_loss")[(("rank", "1"), ("run", "r1"))] == 0.7
    assert total(folder, "robust_step_duration_seconds_count") == 5.0
    assert total(folder, "robust_step_duration_seconds_sum") == 2.5
    a.close()
    b.close()


def test_restarted_rank_leaves_no_stale_series_and_no_double_count(tmp_path: Path,
                                                                    live: set[int]) -> None:
    folder = make_folder(tmp_path, live)
    expected = 0
    for cycle in range(5):
        pid = 200 + cycle
        rank = FakeRank(tmp_path, pid)
        live.add(pid)
        rank.step(4, loss=float(cycle))
        expected += 4
        assert total(folder, "robust_steps_total") == expected
        info = values(folder, "robust_rank_info")
        assert [dict(k)["pid"] for k in info] == [str(pid)]
        assert list(values(folder, "robust_loss").values()) == [float(cycle)]
        rank.close()
        live.discard(pid)  # killed
        # gauges vanish at once, counters stay
        assert values(folder, "robust_rank_info") == {}
        assert total(folder, "robust_steps_total") == expected
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".db")], "dead files not merged"
    archive = json.loads((tmp_path / "archive" / "archive.json").read_text())
    assert sum(v for t, k, v in archive["values"] if "robust_steps" in k) == expected
    assert total(folder, "robust_step_duration_seconds_count") == expected
    # a new sidecar on the same folder reads the archive and agrees
    folder.close()
    again = make_folder(tmp_path, live)
    assert total(again, "robust_steps_total") == expected
    again.close()


@pytest.mark.parametrize("body", ['{"values": [["counter", "k", 1%s]]}' % ("0" * 400),
                                  '{"merged": {"k": 1%s}}' % ("0" * 400),
                                  '{"values": [[1, 2]]}', '{"runs": []}', '[]'])
def test_an_archive_no_reader_can_use_is_started_anew(tmp_path: Path, live: set[int],
                                                      body: str) -> None:
    """The archive lies in the ranks' folder: a value no float holds raised OverflowError out
    of the sidecar's start; it is logged and a new archive begun, like any unreadable one."""
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "archive.json").write_text(body)
    folder = make_folder(tmp_path, live)
    try:
        rank = FakeRank(tmp_path, 400)
        live.add(400)
        rank.step(3)
        assert total(folder, "robust_steps_total") == 3
        rank.close()
    finally:
        folder.close()


def test_one_scrape_sees_one_state_of_a_restarting_rank(tmp_path: Path, live: set[int]) -> None:
    """A scrape's collectors each ask for the folder's state; a rank restarted between two of
    them must not show its new process's steps beside its dead predecessor's liveness."""
    folder = make_folder(tmp_path, live)  # no cache: every snapshot() reads anew
    old = FakeRank(tmp_path, 300)
    live.add(300)
    old.step(2)
    with folder.one_scrape() as pinned:
        live.discard(300)  # killed and restarted while the scrape runs
        new = FakeRank(tmp_path, 301)
        live.add(301)
        new.step(3)
        assert folder.snapshot() is pinned
        assert pinned.alive == {300: True}
    after = folder.snapshot()
    assert after is not pinned
    assert after.alive == {300: False, 301: True}
    folder.close()


def test_collectors_on_the_scrape_threads_read_the_scrapes_state(
        tmp_path: Path, live: set[int]) -> None:
    """The sidecar runs a scrape's collectors concurrently on a thread pool: each must read the
    state its scrape pinned, not a snapshot of its own (which showed a restarted rank's new
    steps beside its predecessor's liveness, 0, in one scrape on a loaded machine)."""
    folder = make_folder(tmp_path, live)  # no cache: every snapshot() reads anew
    read: list[object] = []

    class Reader:
        def collect(self) -> list[object]:
            read.append(folder.snapshot())
            return []

    registry = ScrapeRegistry({"process": Reader(), "ranks": Reader()})
    try:
        with folder.one_scrape() as pinned:
            list(registry.collect())
        assert len(read) == 2 and all(snapshot is pinned for snapshot in read)
    finally:
        registry.close()
        folder.close()


def test_a_rank_that_starts_during_a_read_is_seen_whole_or_not_at_all(
        tmp_path: Path, live: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted rank writes its identity, then its metric files. A read during which it
    starts must not show the new process's metrics beside only its dead predecessor's identity
    (the process collector would then report the rank not alive, with an exit time): the rank
    here starts right after the read has scanned the identities."""
    folder = make_folder(tmp_path, live)
    old = FakeRank(tmp_path, 400)
    live.add(400)
    old.step(2)
    folder.snapshot()
    live.discard(400)  # killed
    scan = folder._identities
    started: list[FakeRank] = []

    def scan_then_restart() -> dict:
        found = scan()
        if not started:
            started.append(FakeRank(tmp_path, 401))
            live.add(401)
            started[0].step(3)
        return found

    monkeypatch.setattr(folder, "_identities", scan_then_restart)
    folder._snapshot = None
    during = folder.snapshot()
    assert set(during.alive) <= set(during.identities), (during.alive, during.identities)
    folder._snapshot = None
    after = folder.snapshot()
    assert set(after.identities) == {400, 401}
    assert after.alive == {400: False, 401: True}
    folder.close()


def test_dead_files_wait_for_quiet_period_before_merge(tmp_path: Path, live: set[int]) -> None:
    rank = FakeRank(tmp_path, 301)
    rank.step(3)
    rank.close()
    folder = make_folder(tmp_path, live, merge_after=30.0)
    # dead but fresh: counted from its files, gauges already gone, files kept
    assert total(folder, "robust_steps_total") == 3.0
    assert values(folder, "robust_loss") == {}
    assert any(p.endswith("_301.db") for p in os.listdir(tmp_path))
    old = time.time() - 60
    for name in os.listdir(tmp_path):
        if name.endswith(".db"):
            os.utime(tmp_path / name, (old, old))
    assert total(folder, "robust_steps_total") == 3.0
    assert not any(p.endswith("_301.db") for p in os.listdir(tmp_path))
    folder.close()


def test_crash_between_archive_save_and_unlink_does_not_double_count(
        tmp_path: Path, live: set[int]) -> None:
    rank = FakeRank(tmp_path, 401)
    rank.step(7)
    rank.close()
    keep = tmp_path / "keep"
    keep.mkdir()
    counter = tmp_path / "counter_401.db"
    os.link(counter, keep / "c")  # same inode, as if the unlink never happened
    folder = make_folder(tmp_path, live)
    assert total(folder, "robust_steps_total") == 7.0
    folder.close()
    os.link(keep / "c", counter)
    again = make_folder(tmp_path, live)
    assert total(again, "robust_steps_total") == 7.0
    assert not counter.exists()
    again.close()


def test_corrupt_files_are_skipped_counted_and_quarantined(tmp_path: Path,
                                                           live: set[int]) -> None:
    good = FakeRank(tmp_path, 501)
    live.add(501)
    good.step(2)
    # a live process's file with a scribbled length, and a dead one's truncated file
    bad_live = tmp_path / "counter_502.db"
    bad_live.write_bytes(struct.pack("i", 64) + b"\0" * 4 + struct.pack("i", 1000) + b"x" * 60)
    live.add(502)
    (tmp_path / "summary_503.db").write_bytes(struct.pack("i", 5000) + b"\0" * 100)
    folder = make_folder(tmp_path, live)
    snap = folder.snapshot()
    assert total(folder, "robust_steps_total") == 2.0
    assert snap.corrupt_total == 2
    assert len(snap.errors) >= 2
    # counted once per file, not once per scrape
    assert folder.snapshot().corrupt_total == 2
    assert not (tmp_path / "summary_503.db").exists()
    assert any("summary_503.db" in p for p in os.listdir(tmp_path / "archive" / "corrupt"))
    assert bad_live.exists(), "a live process's file is never moved"
    folder.close()
    good.close()


def test_finished_run_expires_after_retention(tmp_path: Path, live: set[int]) -> None:
    rank = FakeRank(tmp_path, 601, run="old")
    rank.step(3)
    rank.close()
    folder = make_folder(tmp_path, live, retention=0.5)
    assert total(folder, "robust_steps_total") == 3.0
    time.sleep(0.6)
    assert total(folder, "robust_steps_total") == 0.0
    assert not (tmp_path / "ranks" / "601.json").exists()
    folder.close()


def test_second_sidecar_is_read_only(tmp_path: Path, live: set[int]) -> None:
    owner = make_folder(tmp_path, live)
    other = make_folder(tmp_path, live)
    assert owner.owner and not other.owner
    rank = FakeRank(tmp_path, 701)
    rank.step(2)
    rank.close()
    assert total(other, "robust_steps_total") == 2.0
    assert (tmp_path / "counter_701.db").exists(), "a read-only sidecar never deletes"
    assert total(owner, "robust_steps_total") == 2.0  # merges
    assert total(other, "robust_steps_total") == 2.0  # reads the owner's archive
    owner.close()
    other.close()


def test_reader_rejects_malformed_files(tmp_path: Path) -> None:
    path = tmp_path / "counter_1.db"
    path.write_bytes(b"\x01\x00")
    with pytest.raises(CorruptFile, match="shorter"):
        read_entries(str(path))
    path.write_bytes(struct.pack("i", 0) + b"\0" * 60)
    assert read_entries(str(path)) == []  # created, nothing written yet
    key = b"\xff\xfe"
    path.write_bytes(struct.pack("i", 32) + b"\0" * 4 + struct.pack("i", 2) + key + b"  "
                     + b"\0" * 16)
    with pytest.raises(CorruptFile, match="UTF-8"):
        read_entries(str(path))
    assert parse_name(str(tmp_path), "gauge_mostrecent_12.db").mode == "mostrecent"
    assert parse_name(str(tmp_path), "counter_x.db") is None
    # a job names its files: digits to str.isdigit() that int() refuses are no pid
    for name in ("counter_\u00b2.db", "gauge_all_\u2460.db", "counter_\u0661.db",
                 f"counter_{'1' * 5000}.db"):
        assert parse_name(str(tmp_path), name) is None, name
    assert pid_of("\u00b2.json") is None and pid_of("12.json") == 12
    assert parse_name(str(tmp_path), "archive.json") is None
