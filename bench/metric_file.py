"""Cost of one flush of a rank's metric files: the rank folder's pwrite writer against
prometheus_client's mmap writer (what the hook used before), in the same process.

The store holds the series a CPU DDP rank publishes (every rank metric of the schema, one op
and group for the collective series). Each round flushes it `--flushes` times through each
writer into a fresh folder under /dev/shm (tmpfs, like /run/robust-metrics); the figure is the
fastest round's time per flush, and the ratio new / old. The flusher thread runs a flush every
`flush_interval` (0.25 s by default), off the training thread. Run:

    .venv/bin/python bench/metric_file.py [--flushes 2000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from prometheus_client.mmap_dict import MmapedDict, mmap_key

from robust_metrics import schema
from robust_metrics.hooks.metric_store import MetricStore
from robust_metrics.hooks.sinks import MultiprocessSink, _file_prefix


def make_store() -> MetricStore:
    store = MetricStore({"run": "bench", "rank": "0"})
    for spec in schema.all_metrics(schema.Source.RANK):
        extra = {name: "x" for name in spec.labels if name not in ("run", "rank")}
        series = store.series(spec, **extra)
        if spec.type is schema.MetricType.SUMMARY:
            series.observe(0.01)
        elif spec.type is schema.MetricType.GAUGE:
            series.set(1.0)
        else:
            series.inc()
    return store


class MmapSink:
    """The hook's sink as it was: prometheus_client's MmapedDict, one file per type."""

    def __init__(self, directory: str) -> None:
        self.directory, self.files, self.keys = directory, {}, {}

    def flush(self, store: MetricStore) -> None:
        for sample in store.samples():
            key = (id(sample.series), sample.name)
            slot = self.keys.get(key)
            if slot is None:
                spec = sample.series.spec
                prefix = _file_prefix(spec.type, spec.gauge_mode)
                if prefix not in self.files:
                    self.files[prefix] = MmapedDict(
                        os.path.join(self.directory, f"{prefix}_{os.getpid()}.db"))
                slot = self.keys[key] = (self.files[prefix], mmap_key(
                    spec.base_name, sample.name, list(spec.labels), list(sample.series.labels),
                    spec.help))
            slot[0].write_value(slot[1], sample.value, sample.series.updated)

    def close(self, store: MetricStore) -> None:
        for f in self.files.values():
            f.close()


def per_flush(make_sink, store: MetricStore, flushes: int) -> float:  # type: ignore[no-untyped-def]
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        sink = make_sink(folder)
        sink.flush(store)  # files created outside the timing
        began = time.perf_counter()
        for _ in range(flushes):
            sink.flush(store)
        elapsed = time.perf_counter() - began
        sink.close(store)
        return elapsed / flushes
    finally:
        shutil.rmtree(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flushes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    store = make_store()
    series = sum(1 for _ in store.samples())
    old, new = [], []
    for _ in range(args.rounds):
        old.append(per_flush(MmapSink, store, args.flushes))
        new.append(per_flush(MultiprocessSink, store, args.flushes))
    print(f"{series} samples per flush, fastest of {args.rounds} rounds x {args.flushes}")
    print("| writer | per flush | ratio |\n|---|---|---|")
    print(f"| prometheus_client mmap (before) | {min(old) * 1e6:.1f} µs | 1.00 |")
    print(f"| rankfolder pwrite (now) | {min(new) * 1e6:.1f} µs | {min(new) / min(old):.2f} |")


if __name__ == "__main__":
    main()
