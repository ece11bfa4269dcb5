"""The rules' online straggler estimate against the what-if, on a real pipeline-parallel job.

Four gloo ranks of robust_metrics/workloads/parallel_job.py, `--stack pp_fsdp2`: two pipeline
stages under a real GPipe schedule (torch.distributed.pipelining, 4 micro-batches), each stage
sharded with FSDP2 over 2 data-parallel ranks. The last stage really is heavier: it has twice the
blocks (each block's compute is a fixed sleep, so the imbalance is the layers', not the CPU's).
A micro-batch's forward sleeps 30 ms on the first stage, 60 ms on the last: long against the
scheduling delays of a loaded CPU, which the what-if, op by op, counts as straggling and the
online means average away (at 10 ms, 3 other busy processes on 2 cores parted them by 8%; at
30 ms, with 3 to 8, by 2% or less).
The ranks serve /metrics in-process and record what-if traces through the hook (pipeline sends and
receives from the collective tracker, backward computes from the schedule's
`torch.autograd.backward`); Prometheus evaluates the shipped rules time-scaled to 1 s intervals.
The online slowdown S must be within 10% of `robust-metrics whatif` on the same steps (those the
rules' window held when S was read), and both must give the verdict `stage` for stage 1.
"""

from __future__ import annotations

import time
from pathlib import Path

from robust_metrics import rules, workloads
from robust_metrics.analysis.whatif import analyze, load_model
from robust_metrics.analysis.whatif.report import verdict
from robust_metrics.processes import RankJob
from tests.prometheus_fixture import PrometheusServer
from tests.support import free_port_block, wait_until

JOB = Path(workloads.__file__).resolve().parent / "parallel_job.py"
RUN = "pp-heavy-last-stage"
WINDOW = 20  # seconds: the rules' 5-minute windows at time scale 1/15
TOLERANCE = 0.10


def _online(prom: PrometheusServer) -> dict[str, object] | None:
    s = prom.query(f'run:robust_straggler_slowdown:ratio5m{{run="{RUN}"}}')
    kind = prom.query(f'run:robust_straggler_verdict:class5m{{run="{RUN}"}}')
    stages = prom.query(f'run_stage:robust_straggler_slowdown:ratio5m{{run="{RUN}"}}')
    if not (s and kind and len(stages) == 2):
        return None
    return {"S": float(s[0]["value"][1]), "verdict": kind[0]["metric"]["verdict"],
            "by_stage": {int(r["metric"]["pp_rank"]): float(r["value"][1]) for r in stages}}


def _window_steps(prom: PrometheusServer, at: float) -> range:
    """The steps the rules' window held at `at`: what the online S was computed from.

    The what-if over the whole run would also count start-up and any moment of contention outside
    the window, which the online S never saw.
    """
    def step(fn: str, t: float) -> int:
        return int(float(prom.query(f'{fn}(robust_global_step{{run="{RUN}"}})', at=t)[0]["value"][1]))
    return range(step("min", at - WINDOW), step("max", at) + 1)


def test_a_heavy_last_stage_is_the_verdict_online_and_in_the_what_if(tmp_path: Path) -> None:
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(rules.render(rules.load_groups(time_scale=1 / 15)))
    port = free_port_block(4)
    trace = tmp_path / "trace"
    args = ["--stack", "pp_fsdp2", "--schedule", "gpipe", "--compute", "0.24",
            "--heavy-last-stage", "2", "--duration", "600", "--trace-dir", str(trace),
            "--trace-every", "3"]
    with RankJob(4, args, script=JOB, env={"ROBUST_METRICS_PORT": str(port)}, log_dir=tmp_path,
                 run=RUN) as job, \
            PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{port + r}" for r in range(4)],
                             rule_files=[rule_file]) as prom:
        prom.wait_for_targets_up(4, timeout=90)
        time.sleep(WINDOW + 8)  # the windows fill with steps after start-up
        online = wait_until(lambda: _online(prom), timeout=60, interval=1,
                            message=lambda: f"attribution\n{job.logs()}")
        steps = _window_steps(prom, time.time())
        job.kill()
    result = analyze(load_model(trace, steps=steps))
    report = (f"online S={online['S']:.3f} verdict={online['verdict']} "
              f"stages={online['by_stage']}; what-if S={result.slowdown:.3f} "
              f"verdict={verdict(result)} M_W={result.mw} M_S={result.ms} "
              f"stages={result.by_stage} steps={steps.start}-{steps.stop - 1}")
    print(report)
    assert abs(online["S"] - result.slowdown) / result.slowdown < TOLERANCE, report
    assert online["verdict"] == verdict(result) == "stage", report
    assert max(online["by_stage"], key=online["by_stage"].__getitem__) == 1 == next(
        iter(result.by_stage)), report
