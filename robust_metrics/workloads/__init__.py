"""Training jobs that exercise the rules: real gloo ranks with one `watch()` line each.

- `fault_job.py`: a DDP job (an MLP with Adam) whose options inject one fault each (a stop inside
  a collective, a slow rank, NaN loss or gradients, spikes, a data stall, a GC storm, checkpoint
  and eval phases, a slow shutdown); run by the end-to-end alert tests and
  bench/detection_matrix.py;
- `parallel_job.py`: the same with FSDP2, tensor parallelism, pipeline schedules and 2-D meshes,
  with a slowed rank;
- `straggler_series.py`: no processes, but the series such a job would publish, drawn at random
  (per-step jitter, slow ranks, contention that moves between ranks, a checkpoint pause): the
  input of the statistical slow-rank cases (alert_rules/tests/stragglers_stat_test.yml) and of
  bench/straggler_curve.py. It needs no torch;
- `trace_series.py`: the same series for a recorded what-if op trace, its sampled steps played end
  to end (the input of alert_rules/tests/whatif_st_test.yml, which holds the rules' S and verdict
  to `robust-metrics whatif` on the study's trace ST). It needs the `analysis` extra, not torch.

Anyone who wants to see an alert fire on their own Prometheus can run them too
(`python -m robust_metrics.workloads.fault_job --help`). `FAULT_JOB` is the fault job's path, for
`robust_metrics.processes.RankJob(script=FAULT_JOB)`. The jobs need torch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FAULT_JOB"]

FAULT_JOB = Path(__file__).resolve().parent / "fault_job.py"
