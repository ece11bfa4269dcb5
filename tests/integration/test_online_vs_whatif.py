"""The rules' online slowdown estimate against the what-if simulator, on one real job.

A 4-rank gloo job with rank 2 slowed serves /metrics in-process and records sampled op traces;
Prometheus evaluates the shipped rules (time-scaled to 1 s intervals). Both methods must name
rank 2; the test reports how far their slowdowns S differ (bench/README.md, "Summary").
"""

from __future__ import annotations

import time
from pathlib import Path

from robust_metrics import rules
from robust_metrics.analysis.whatif import analyze, load_model
from tests.prometheus_fixture import PrometheusServer
from tests.support import RankJob, free_port_block, wait_until

JOB = Path(__file__).resolve().parent.parent / "whatif_trace_job.py"
RUN = "online-vs-whatif"
SLOW = 2
TIME_SCALE = 1 / 15


def test_online_estimate_and_simulator_agree_on_the_slow_rank(tmp_path: Path) -> None:
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(rules.render(rules.load_groups(time_scale=TIME_SCALE)))
    port = free_port_block(4)
    trace = tmp_path / "trace"
    env = {"TRACE_DIR": str(trace), "TRACE_EVERY": "5", "TRACE_STEPS": "1",
           "ROBUST_METRICS_PORT": str(port)}
    args = ["--steps", "1000000", "--slow-rank", str(SLOW), "--slow-seconds", "0.05"]
    with RankJob(4, args, script=JOB, env=env, log_dir=tmp_path, run=RUN) as job, \
            PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{port + r}" for r in range(4)],
                             rule_files=[rule_file]) as prom:
        prom.wait_for_targets_up(4, timeout=60)
        started = time.monotonic()

        def estimate() -> float | None:
            result = prom.query(f'run:robust_straggler_slowdown:ratio5m{{run="{RUN}"}}')
            if not result or time.monotonic() - started < 30:  # let the 20 s windows fill
                return None
            return float(result[0]["value"][1])

        online = wait_until(estimate, timeout=120, interval=1,
                            message=lambda: f"online slowdown estimate\n{job.logs()}")
        ratios = {int(r["metric"]["rank"]): float(r["value"][1]) for r in prom.query(
            f'max without (window) (robust_step_compute_mean_seconds{{run="{RUN}",window="5m"}}'
            f' / on (run) group_left () run:robust_step_compute_seconds:median5m)')}
    result = analyze(load_model(trace, steps=range(5, 10_000_000)))  # step 0 is warm-up
    online_slow = max(ratios, key=ratios.__getitem__)
    whatif_slow = next(iter(result.by_dp_rank))
    difference = abs(online - result.slowdown) / result.slowdown
    print(f"online S={online:.3f} (slow rank {online_slow}, ratios {ratios}); "
          f"what-if S={result.slowdown:.3f} (slow rank {whatif_slow}); "
          f"difference {100 * difference:.1f}%")
    assert online_slow == whatif_slow == SLOW
    assert online > 1.1 and result.slowdown > 1.1
