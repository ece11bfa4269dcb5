"""The rank folder under attack or failure: a full or vanishing folder must not stop training,
and nothing a job plants in the folder (links, FIFOs, huge files, identities of other processes)
may make the sidecar read, write, block or dump what it should not.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from robust_metrics import cli, schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink
from robust_metrics.rankfolder import control, metricfile, write_identity
from robust_metrics.rankfolder.control import read_checkpoint_request_safely
from robust_metrics.sidecar.cli import build
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.rank_files import RankFiles
from robust_metrics.sidecar.stacks import find_py_spy
from tests.support import ROOT

TOKEN = "hostile-token"


def _store(run: str = "r", rank: str = "0") -> MetricStore:
    store = MetricStore({"run": run, "rank": rank})
    store.series(schema.STEPS_TOTAL).inc(3)
    store.series(schema.LOSS).set(1.0)
    return store


def _finishes(fn: Callable[[], object], seconds: float) -> bool:
    """Whether `fn()` returns within `seconds` (run in a daemon thread that may stay blocked)."""
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        finally:
            done.set()

    threading.Thread(target=target, daemon=True).start()
    return done.wait(seconds)


def _release_fifo(path: Path) -> None:
    """Open a FIFO for writing once, so a reader blocked on it (before the fix) gets unstuck."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


# -- the hook: a full or vanishing folder -------------------------------------------------------
@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs filled to the last byte (needs root to mount; skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the fake-ENOSPC test covers the logic")
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        (mount / "ranks").mkdir()
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


TRAIN_ON = textwrap.dedent("""
    import sys, torch, robust_metrics
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = robust_metrics.watch(model, opt, backend="multiprocess", metrics_dir=sys.argv[1],
                                  run="full", rank=0, world_size=1, flush_interval=0)
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    errors = sum(s.value for s in handle.store.samples()
                 if s.name == "robust_hook_errors_total")
    steps = [s.value for s in handle.store.samples() if s.name == "robust_steps_total"]
    handle.close()
    print("steps", steps[0], "errors", errors)
""")


def test_a_full_tmpfs_never_kills_training_and_the_errors_are_counted(full_tmpfs: Path) -> None:
    done = subprocess.run([sys.executable, "-c", TRAIN_ON, str(full_tmpfs)], capture_output=True,
                          timeout=120, cwd=ROOT, check=False)
    out = done.stdout.decode()
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])
    steps, errors = float(out.split()[1]), float(out.split()[3])
    assert steps == 5 and errors >= 5, out


def test_no_space_at_the_writer_is_an_error_the_hook_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metricfile.os, "posix_fallocate", no_space)
    sink = MultiprocessSink(str(tmp_path), pid=123)
    with pytest.raises(OSError) as info:
        sink.flush(_store())
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []  # no empty file left for the sidecar to flag as corrupt


def test_a_removed_folder_is_written_again_with_the_identity(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    sink = MultiprocessSink(str(folder), pid=os.getpid())
    calls = []
    sink.on_reopen = lambda: calls.append(write_identity(
        str(folder), run="r", rank=0, local_rank=0, node="n", world_size=1))
    store = _store()
    sink.flush(store)
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    store.series(schema.STEPS_TOTAL).inc(2)
    sink.flush(store)
    entries = metricfile.read_entries(str(folder / f"counter_{os.getpid()}.db"))
    assert [e.value for e in entries] == [5.0]
    assert calls and (folder / "ranks" / f"{os.getpid()}.json").exists()
    sink.close(store)


def test_a_link_planted_at_the_ranks_file_name_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "counter_77.db").symlink_to(victim)
    sink = MultiprocessSink(str(folder), pid=77)
    with pytest.raises(OSError):
        sink.flush(_store())
    assert victim.read_text() == "precious"


def test_the_hook_never_blocks_on_a_fifo_control_file(tmp_path: Path) -> None:
    (tmp_path / "control").mkdir()
    fifo = tmp_path / "control" / "checkpoint.json"
    os.mkfifo(fifo)
    try:
        assert _finishes(lambda: read_checkpoint_request_safely(str(tmp_path)), 3.0)
    finally:
        _release_fifo(fifo)


# -- the sidecar: links, FIFOs, large files -----------------------------------------------------
def _rank_file(path: Path, value: float = 5.0, run: str = "r") -> None:
    f = metricfile.MetricFile(str(path))
    f.write(metricfile.metric_key(schema.STEPS_TOTAL.base_name, schema.STEPS_TOTAL.name,
                                  ["run", "rank"], [run, "0"], schema.STEPS_TOTAL.help),
            value, 0.0)
    f.sync()
    f.close()


def _series(folder: RankFiles) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in folder.snapshot().families
            for s in fam.samples]


def test_links_out_of_the_folder_are_never_read(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    _rank_file(outside / "counter_4001.db", run="stolen")
    (outside / "4001.json").write_text('{"run": "stolen", "rank": 0}')
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "counter_4001.db").symlink_to(outside / "counter_4001.db")
    (folder / "ranks").symlink_to(outside)
    rank_folder = RankFiles(str(folder), alive=lambda pid, started: True)
    try:
        snap = rank_folder.snapshot()
        assert snap.identities == {}
        assert not any(labels.get("run") == "stolen" for _, labels, _ in _series(rank_folder))
    finally:
        rank_folder.close()


def test_links_in_the_archive_never_make_the_sidecar_write_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "file"
    target.write_text("precious")
    folder = tmp_path / "m"
    (folder / "archive").mkdir(parents=True)
    (folder / "archive" / "archive.json.tmp").symlink_to(target)
    (folder / "archive" / "archive.json").symlink_to(target)
    _rank_file(folder / "counter_4002.db")
    rank_folder = RankFiles(str(folder), merge_after=0, alive=lambda pid, started: False)
    try:
        assert [v for n, _, v in _series(rank_folder) if n == schema.STEPS_TOTAL.name] == [5.0]
    finally:
        rank_folder.close()
    assert target.read_text() == "precious"
    # a link in place of the whole archive folder: the sidecar serves read-only
    other = tmp_path / "m2"
    other.mkdir()
    (other / "archive").symlink_to(outside)
    _rank_file(other / "counter_4003.db")
    rank_folder = RankFiles(str(other), merge_after=0, alive=lambda pid, started: False)
    try:
        assert not rank_folder.owner
        rank_folder.snapshot()
    finally:
        rank_folder.close()
    assert sorted(os.listdir(outside)) == ["file"] and target.read_text() == "precious"
    assert (other / "counter_4003.db").exists()


def test_fifos_never_block_a_scrape_or_the_event_loop(tmp_path: Path) -> None:
    config = SidecarConfig(directory=str(tmp_path / "m"), node="n1", collectors=["ranks"],
                           sysfs=str(tmp_path))
    config.validate()
    os.makedirs(tmp_path / "m" / "ranks")
    fifos = [tmp_path / "m" / "counter_4004.db", tmp_path / "m" / "ranks" / "4004.json"]
    for fifo in fifos:
        os.mkfifo(fifo)
    app, folder, _ = build(config)
    try:
        with TestClient(app) as client:
            got: dict[str, int] = {}
            assert _finishes(lambda: got.setdefault(
                "metrics", client.get("/metrics").status_code), 4.0)
            assert got["metrics"] == 200
            assert client.get("/healthz").status_code == 200
    finally:
        for fifo in fifos:
            _release_fifo(fifo)
        folder.close()


RSS_OF_A_SCRAPE = textwrap.dedent("""
    import resource, sys
    from robust_metrics.sidecar.rank_files import RankFiles
    folder = RankFiles(sys.argv[1], alive=lambda pid, started: True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    snap = folder.snapshot()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) // 1024, snap.corrupt_total)
""")


def test_a_huge_sparse_file_does_not_blow_the_sidecars_memory(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    huge = folder / "counter_4005.db"
    with open(huge, "wb") as f:
        f.write((256 << 20).to_bytes(4, "little") + b"\0" * 4)
        f.truncate(256 << 20)  # sparse: no disk used
    done = subprocess.run([sys.executable, "-c", RSS_OF_A_SCRAPE, str(folder)],
                          capture_output=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    grown_mib, corrupt = (int(x) for x in done.stdout.split())
    assert grown_mib < 16 and corrupt == 1, done.stdout


def test_an_identity_whose_times_no_float_holds_is_skipped_not_a_crash(tmp_path: Path) -> None:
    """The job writes its identity: a start of 10**400 made float() raise OverflowError out of
    the sidecar's folder scan; an infinite or NaN start was taken as a time; a crash time of
    10**400 raised too. A bad start skips the identity (as text there does), a bad crash time is
    ignored, and the other ranks are read."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    huge = "1" + "0" * 400
    bodies = {5001: f'{{"run": "r", "rank": 1, "started": {huge}}}',
              5002: '{"run": "r", "rank": 2, "started": Infinity}',
              5003: '{"run": "r", "rank": 3, "started": NaN}',
              5004: f'{{"run": "r", "rank": 4, "started": 5, "crashed": {huge}}}',
              5005: '{"run": "r", "rank": 5, "started": 5}'}
    for pid, body in bodies.items():
        (ranks / f"{pid}.json").write_text(body)
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: True, cache_seconds=0)
    try:
        identities = folder.snapshot().identities
    finally:
        folder.close()
    assert sorted(identities) == [5004, 5005]
    assert identities[5004].started == 5.0 and identities[5004].crashed is None


def test_one_scrape_reads_a_bounded_number_of_bytes(tmp_path: Path) -> None:
    for pid in (4010, 4011, 4012):
        _rank_file(tmp_path / f"counter_{pid}.db", run=f"run{pid}")
    folder = RankFiles(str(tmp_path), alive=lambda pid, started: True, max_scrape_bytes=1)
    try:
        snap = folder.snapshot()
        assert len({labels["run"] for _, labels, _ in _series(folder)}) == 1
        assert sum("not read, this scrape already read 1 bytes" in e for e in snap.errors) == 2
    finally:
        folder.close()


def test_a_checkpoint_request_is_never_written_through_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "control").symlink_to(outside)
    with pytest.raises(OSError):
        control.write_checkpoint_request(str(folder))
    assert os.listdir(outside) == []


# -- the sidecar acts only on proven ranks --------------------------------------------------------
SECRET_HOLDER = textwrap.dedent("""
    import time
    def hold():
        secret_api_key = "sk-do-not-leak"
        while True:
            time.sleep(0.05)
    hold()
""")


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[TestClient, Path]]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    config = SidecarConfig(directory=str(tmp_path / "m"), node="n1", collectors=["ranks"],
                           sysfs=str(tmp_path), token_file=str(token))
    config.validate()
    app, folder, _ = build(config)
    with TestClient(app) as client:
        yield client, tmp_path / "m"
    folder.close()


def test_a_process_named_in_ranks_but_not_a_rank_is_never_dumped(
        sidecar: tuple[TestClient, Path]) -> None:
    if find_py_spy() is None:
        pytest.skip("py-spy not installed (pip install robust-metrics[sidecar])")
    client, folder = sidecar
    victim = subprocess.Popen([sys.executable, "-c", SECRET_HOLDER])
    try:
        time.sleep(0.5)
        (folder / "ranks" / f"{victim.pid}.json").write_text(json.dumps(
            {"run": "r", "rank": 0, "started": time.time()}))
        response = client.get("/debug/stacks?locals=1",
                              headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200
        assert "sk-do-not-leak" not in response.text
        (entry,) = response.json()["ranks"]
        assert entry["pid"] == victim.pid and entry["threads"] == []
        assert "not proven a rank" in entry["error"]
    finally:
        victim.kill()
        victim.wait()


def test_stacks_metrics_dir_never_dumps_a_process_that_is_not_a_rank(tmp_path: Path) -> None:
    if find_py_spy() is None:
        pytest.skip("py-spy not installed (pip install robust-metrics[sidecar])")
    victim = subprocess.Popen([sys.executable, "-c", SECRET_HOLDER])
    try:
        time.sleep(0.5)
        write_identity(str(tmp_path), run="r", rank=0, local_rank=0, node="n", world_size=1,
                       pid=victim.pid)
        out = io.StringIO()
        with redirect_stdout(out):
            code = cli.main(["stacks", "--metrics-dir", str(tmp_path), "--samples", "1",
                             "--json"])
        assert code == 3  # nothing could be analysed
        assert "sk-do-not-leak" not in out.getvalue()
        (error,) = json.loads(out.getvalue())["errors"]
        assert error["rank"] == 0 and "not proven a rank" in error["error"]
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "1e999"])
def test_a_non_finite_stack_timeout_is_a_400(sidecar: tuple[TestClient, Path],
                                             timeout: str) -> None:
    client, _ = sidecar
    response = client.get(f"/debug/stacks?timeout={timeout}",
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 400
    assert "finite" in response.json()["error"]


# -- the folder's modes: ranks create, nobody lists, only the sidecar controls -------------------
NOBODY = 65534


def _write_as_a_rank_of(uid: int, folder: str) -> int:
    """In a forked child running as `uid` (umask 077): write an identity and a metric file the
    way the hook does. Exit status 0: written, and the folder could not be listed."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0o077)  # a strict site umask must not hide the files from the sidecar
            write_identity(folder, run="r", rank=0, local_rank=0, node="n", world_size=1)
            store = MetricStore({"run": "r", "rank": "0"})
            store.series(schema.STEPS_TOTAL).inc(4)
            MultiprocessSink(folder).flush(store)
            try:
                os.listdir(folder)
                code = 3
            except PermissionError:
                code = 0
        except BaseException as exc:
            os.write(2, f"rank as uid {uid} failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a rank as another user")
def test_a_rank_of_another_user_writes_into_the_folder_it_cannot_list() -> None:
    base = Path(tempfile.mkdtemp(prefix="rankfolder-"))  # pytest's tmp_path is root's alone
    os.chmod(base, 0o755)
    folder = base / "m"
    rank_folder = RankFiles(str(folder))  # the sidecar sets the layout up
    try:
        assert _write_as_a_rank_of(NOBODY, str(folder)) == 0
        snap = rank_folder.snapshot()
        assert [(i.run, i.uid) for i in snap.identities.values()] == [("r", NOBODY)]
        steps = [s.value for f in snap.families for s in f.samples
                 if s.name == schema.STEPS_TOTAL.name]
        assert steps == [4.0]
    finally:
        rank_folder.close()
        shutil.rmtree(base)


@pytest.mark.parametrize("body", ['{"id": 1e999}', '{"id": 1.5}', '{"id": true}',
                                  '{"id": "7"}', '{"id": -1}', '{"id": 9007199254740992}',
                                  '{"id": 7, "at_step": NaN}', '{"id": 7, "at_step": 2.5}',
                                  '[7]', '{}'])
def test_a_checkpoint_request_that_is_not_whole_numbers_is_ignored(tmp_path: Path,
                                                                    body: str) -> None:
    """The hook acknowledges the request's id and checkpoints at its step: a fraction would be
    another request, and an infinity raised OverflowError past the reader's error handling."""
    control.write_checkpoint_request(str(tmp_path), request_id=7, at_step=12)
    assert control.read_checkpoint_request(str(tmp_path)) == control.CheckpointRequest(7, 12)
    (tmp_path / "control" / "checkpoint.json").write_text(body)
    with pytest.raises((ValueError, KeyError, AttributeError)):
        control.read_checkpoint_request(str(tmp_path))
    assert read_checkpoint_request_safely(str(tmp_path)) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file another owner")
def test_a_checkpoint_request_written_by_another_job_is_ignored(tmp_path: Path) -> None:
    control.write_checkpoint_request(str(tmp_path), request_id=7)
    assert control.read_checkpoint_request(str(tmp_path)).id == 7
    os.chown(tmp_path / "control" / "checkpoint.json", 4321, 4321)
    assert read_checkpoint_request_safely(str(tmp_path)) is None
