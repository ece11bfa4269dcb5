"""The rank folder's formats, writer and reader in one module: identity, metric files, control."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from robust_metrics import schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink
from robust_metrics.rankfolder import (
    MetricFile,
    metric_key,
    rank_info,
    read_entries,
    read_identities,
    write_identity,
)
from robust_metrics.sidecar.rank_files import RankFiles


def test_metric_files_are_prometheus_client_multiprocess_files(tmp_path: Path) -> None:
    store = MetricStore({"run": "r", "rank": "3"})
    store.series(schema.STEPS_TOTAL).inc(7)
    store.series(schema.LOSS).set(0.25)
    store.series(schema.STEP_DURATION).observe(1.5)
    sink = MultiprocessSink(str(tmp_path), pid=4242)
    sink.flush(store)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    labels = {"run": "r", "rank": "3"}
    assert registry.get_sample_value(schema.STEPS_TOTAL.name, labels) == 7
    assert registry.get_sample_value(schema.LOSS.name, labels) == 0.25
    assert registry.get_sample_value(f"{schema.STEP_DURATION.name}_sum", labels) == 1.5
    sink.close(store)


def test_writer_and_reader_agree_on_keys_of_every_padding(tmp_path: Path) -> None:
    path = str(tmp_path / "counter_1.db")
    f = MetricFile(path)
    keys = [metric_key("m", "m_total", ["l"], ["x" * n], "h") for n in range(12)]
    for i, key in enumerate(keys):
        f.write(key, float(i), 0.0)
    f.sync()
    assert [(e.key, e.value) for e in read_entries(path)] == [
        (k, float(i)) for i, k in enumerate(keys)]
    f.close()


def test_identity_is_read_the_same_by_the_sidecar_and_stacks(tmp_path: Path) -> None:
    write_identity(str(tmp_path), run="j1", rank=5, local_rank=1, node="n2", world_size=8,
                   topology={"dp_rank": 1, "pp_rank": 2, "tp_rank": 0})
    pid = os.getpid()
    (ident,) = read_identities(str(tmp_path)).values()
    assert ident.labels() == {"run": "j1", "rank": "5", "pid": str(pid), "local_rank": "1",
                              "node": "n2", "world_size": "8", "dp_rank": "1", "pp_rank": "2",
                              "tp_rank": "0"}
    assert ident.uid == os.geteuid()
    folder = RankFiles(str(tmp_path))
    try:
        assert folder.snapshot().identities == {pid: ident}
    finally:
        folder.close()
    assert rank_info([ident]) == [{"run": "j1", "rank": "5", "pid": str(pid), "node": "n2",
                                   "local_rank": "1", "world_size": "8", "dp_rank": "1",
                                   "pp_rank": "2", "tp_rank": "0"}]


def test_an_identity_file_cannot_claim_another_pid(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "77.json").write_text('{"run": "r", "rank": 0, "pid": 1}')
    assert set(read_identities(str(tmp_path))) == {77}


def test_the_write_interval_in_an_identity_is_read_only_when_it_is_a_duration(
        tmp_path: Path) -> None:
    """The sidecar uses the hook's write interval to tell stale files; the file is the job's, so
    a value that is no plausible number of seconds is ignored rather than trusted."""
    write_identity(str(tmp_path), run="j1", rank=0, local_rank=0, node="n", world_size=1,
                   flush_interval=0.25)
    (ident,) = read_identities(str(tmp_path)).values()
    assert ident.flush_interval == 0.25
    for hostile in ('"0.25"', "true", "-1", "0", "1e300", "NaN", "[1]"):
        (tmp_path / "ranks" / "77.json").write_text(
            f'{{"run": "r", "rank": 0, "flush_interval": {hostile}}}')
        assert read_identities(str(tmp_path))[77].flush_interval is None, hostile
