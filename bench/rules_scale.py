"""Rule evaluation cost at scale: a real Prometheus scraping a synthetic 16,384-rank job.

    .venv/bin/python bench/rules_scale.py [--ranks 16384] [--duration 180] [--interval 15s]

A synthetic exporter serves, for every rank, the series the hook publishes in-process (every rank
metric of the schema, one op/group for the collective metrics, three phases) plus the per-rank
series of the node sidecar (liveness, CPU, memory, step age, GPU mapping), split over one scrape
target per 512 ranks (a node sidecar serves 8; the split only changes scrape parallelism). Rank 7
computes 50% longer than the others so the straggler rules have something to find. Prometheus
evaluates the shipped rules at production intervals (15 s), and the benchmark reports each rule
group's evaluation time (`evaluationTime` of /api/v1/rules, the value of
`prometheus_rule_group_last_duration_seconds`), series per rank, and Prometheus' memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from robust_metrics import rules, schema
from robust_metrics.processes import Prometheus, free_port

SLOW_RANK = 7
RUN = "bench"

# value key of each sample name; %(key)s placeholders are filled once per scrape
SAMPLE_KEYS = {
    "robust_steps_total": "steps", "robust_last_step_timestamp_seconds": "now",
    "robust_global_step": "steps", "robust_step_duration_seconds_sum": "steps",
    "robust_step_duration_seconds_count": "steps", "robust_step_compute_seconds_sum": "compute",
    "robust_step_compute_seconds_count": "steps", "robust_data_wait_seconds_sum": "small",
    "robust_data_wait_seconds_count": "steps", "robust_gc_pause_seconds_sum": "small",
    "robust_gc_pause_seconds_count": "steps", "robust_loss": "loss", "robust_grad_norm": "one",
    "robust_collective_duration_seconds_sum": "blocked",
    "robust_collective_duration_seconds_count": "steps",
    "robust_collective_bytes_total": "bytes", "robust_collectives_entered_total": "steps",
    "robust_collectives_completed_total": "steps", "robust_rank_step_age_seconds": "small",
    "robust_rank_process_cpu_seconds_total": "steps", "robust_last_checkpoint_timestamp_seconds":
    "start", "robust_rank_process_resident_memory_bytes": "bytes",
}


def _labels(spec: schema.MetricSpec, rank: int, node: int) -> list[str]:
    """Label sets of one rank's series of `spec` (one op/group, three phases)."""
    base = {"run": RUN, "rank": str(rank)}
    if spec.name == "robust_phase":
        return [f'run="{RUN}",rank="{rank}",phase="{p}"' for p in schema.PHASES]
    extra = {"op": "all_reduce", "group": "default_pg", "node": f"node{node}",
             "gpu": str(rank % 8), "uuid": f"GPU-{rank}", "local_rank": str(rank % 8),
             "world_size": "16384", "pid": str(10000 + rank), "dp_rank": str(rank),
             "pp_rank": "0", "tp_rank": "0"}
    values = {**extra, **base}
    return [",".join(f'{name}="{values[name]}"' for name in spec.labels)]


def rank_specs() -> list[schema.MetricSpec]:
    """Per-rank metrics published by default on a CPU rank (no CUDA memory, no hook errors)."""
    skip = {"robust_cuda_memory_allocated_bytes", "robust_cuda_memory_reserved_bytes",
            "robust_cuda_memory_peak_bytes", "robust_hook_errors_total"}
    return [m for m in schema.all_metrics()
            if m.default_on and m.name not in skip and "rank" in m.labels
            and m.source in (schema.Source.RANK, schema.Source.SIDECAR)]


def shard_template(ranks: range) -> str:
    lines = []
    for rank in ranks:
        node = rank // 8
        for spec in rank_specs():
            for labels in _labels(spec, rank, node):
                for sample in spec.sample_names():
                    key = SAMPLE_KEYS.get(sample, "one")
                    if rank == SLOW_RANK and key in ("compute", "blocked"):
                        key += "_slow"
                    if sample == "robust_phase":
                        key = "one" if labels.endswith('"train"') else "zero"
                    lines.append(f"{sample}{{{labels}}} %({key})s")
    return "\n".join(lines).replace("%(", "\0").replace("%", "%%").replace("\0", "%(") + "\n"


class Exporter:
    """Serves /shard/<i> for every shard; values advance with wall time (1 step per second)."""

    def __init__(self, ranks: int, per_target: int) -> None:
        self.templates = [shard_template(range(i, min(i + per_target, ranks)))
                          for i in range(0, ranks, per_target)]
        self.series = sum(t.count("\n") for t in self.templates)
        self.start = time.time()
        self.port = free_port()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    shard = int(self.path.rsplit("/", 1)[1])
                    body = (exporter.templates[shard] % exporter.values()).encode()
                except (ValueError, IndexError):
                    self.send_error(404, "no such shard")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def values(self) -> dict[str, str]:
        now = time.time()
        t = now - self.start
        return {"steps": f"{t:.3f}", "now": f"{now:.3f}", "start": f"{self.start:.3f}",
                "compute": f"{0.6 * t:.3f}", "compute_slow": f"{0.9 * t:.3f}",
                "blocked": f"{0.4 * t:.3f}", "blocked_slow": f"{0.1 * t:.3f}",
                "small": f"{0.01 * t:.3f}", "loss": "2.0", "one": "1", "zero": "0",
                "bytes": f"{1e6 * t:.0f}"}

    def __enter__(self) -> Exporter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--per-target", type=int, default=512)
    parser.add_argument("--duration", type=float, default=180, help="seconds of evaluation")
    parser.add_argument("--interval", default="15s", help="scrape and evaluation interval")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp, Exporter(args.ranks, args.per_target) as exporter:
        print(f"exporter: {args.ranks} ranks, {exporter.series} series "
              f"({exporter.series / args.ranks:.1f} per rank), {len(exporter.templates)} targets")
        rule_file = Path(tmp) / "rules.yml"
        # baseline: the cheapest useful rules over every rank, to express group costs as ratios
        # in the same run (this 2-core VM is shared, so absolute times swing with its load)
        baseline = {"name": "bench-baseline", "rules": [
            {"record": "bench:robust_global_step:count", "expr": "count(robust_global_step)"},
            {"record": "bench:robust_steps:rate5m_sum",
             "expr": "sum(rate(robust_steps_total[5m]))"}]}
        rule_file.write_text(rules.render([*rules.load_groups(), baseline]))
        scrape = [{"job_name": f"shard{i}", "metrics_path": f"/shard/{i}",
                   "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}
                  for i in range(len(exporter.templates))]
        prom = Prometheus(Path(tmp) / "prom", [], rule_files=[rule_file],
                          scrape_interval=args.interval, evaluation_interval=args.interval,
                          extra_scrape_configs=scrape)
        with prom:
            durations: dict[str, list[float]] = {}
            seen: set[tuple[str, str]] = set()
            deadline = time.monotonic() + args.duration
            while time.monotonic() < deadline:
                time.sleep(2)
                for group in prom.api("rules")["groups"]:
                    key = (group["name"], group["lastEvaluation"])
                    if group["lastEvaluation"].startswith("0001") or key in seen:
                        continue
                    seen.add(key)
                    durations.setdefault(group["name"], []).append(group["evaluationTime"])
            print(json.dumps({name: {"evaluations": len(v), "median_s": statistics.median(v),
                                     "max_s": max(v)} for name, v in sorted(durations.items())}),
                  flush=True)
            slowest = sorted(((r["evaluationTime"], r["name"])
                              for g in prom.api("rules")["groups"] for r in g["rules"]),
                             reverse=True)[:8]
            errors = [r["name"] for g in prom.api("rules")["groups"]
                      for r in g["rules"] if r.get("health") == "err"]
            # per-record counts are cheap; a count over every series is not at this size
            rank_records = [r["record"] for r in rules.recording_rules(rules.load_groups())
                            if r["record"].split(":")[0] in ("run_rank", "node_gpu")]
            recorded_rank = sum(float(v[0]["value"][1]) for v in
                                (prom.query(f"count({name})") for name in rank_records) if v)
            head = prom.api("status/tsdb")["headStats"]
            scrape_s = [float(r["value"][1]) for r in prom.query("scrape_duration_seconds")]
            slowdown = prom.query("run:robust_straggler_slowdown:ratio5m")
            slow = prom.query("run_rank:robust_step_compute_seconds:ratio_to_median5m > 1.25")
            rss = psutil.Process(prom.proc.pid).memory_info().rss if prom.proc else 0
            # Quiet replay: stop the exporter (no more ingestion), then run every rule's
            # expression as an instant query at a moment inside the data, in group order,
            # and sum the engine's own timings per group.
            t_query = time.time() - 2 * rules.parse_duration(args.interval) / 1000
            exporter.server.shutdown()
            time.sleep(3 * rules.parse_duration(args.interval) / 1000)
            quiet: dict[str, list[float]] = {}
            per_rule: dict[str, float] = {}
            for _ in range(3):
                for group in [*rules.load_groups(), baseline]:
                    total = 0.0
                    for rule in group["rules"]:
                        data = prom.api("query", query=rule["expr"], time=t_query, stats="all")
                        took = float(data["stats"]["timings"]["execTotalTime"])
                        total += took
                        name = rule.get("record") or rule.get("alert")
                        per_rule[name] = min(per_rule.get(name, took), took)
                    quiet.setdefault(group["name"], []).append(total)
    base = statistics.median(durations.get("bench-baseline", [0.0])) or float("nan")
    result = {
        "ranks": args.ranks, "interval": args.interval,
        "scraped_series_per_rank": exporter.series / args.ranks,
        "recorded_rank_series_per_rank": recorded_rank / args.ranks,
        "head_series_total": head["numSeries"],
        "prometheus_rss_gib": rss / 2**30,
        "scrape_duration_s_max": max(scrape_s, default=0.0),
        "rule_errors": errors,
        "straggler_slowdown": slowdown[0]["value"][1] if slowdown else None,
        "slow_ranks_found": [s["metric"]["rank"] for s in slow],
        "slowest_rules_last_eval_s": [(name, round(t, 4)) for t, name in slowest],
        "quiet_slowest_rules_s": sorted(((round(t, 4), n) for n, t in per_rule.items()),
                                        reverse=True)[:8],
        "quiet_replay_s": {name: round(statistics.median(v), 4) for name, v in quiet.items()},
        "groups": {name: {"evaluations": len(v), "median_s": round(statistics.median(v), 4),
                          "max_s": round(max(v), 4),
                          "median_x_baseline": round(statistics.median(v) / base, 1)}
                   for name, v in sorted(durations.items())},
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
