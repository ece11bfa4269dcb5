"""What-if analysis cost: time and peak memory, vectorised against the simplest correct version.

Cases, each in its own child process so peak RSS (ru_maxrss) belongs to that case alone:
- fixture ST (dp 2 x pp 4, 32 steps): load + full analysis (S, attribution, M_W, M_S), with the
  vectorised simulator and with the naive one (one op instance at a time, simulate_naive) doing
  the same scenarios;
- a synthetic 1F1B trace of 16,384 ranks (dp 2048 x pp 8, 8 microbatches) x 10 steps with one slow
  worker: load from parquet + full analysis, vectorised only (the naive one would take hours).
Run:

    .venv/bin/python bench/whatif.py [--skip-large] [--dp 2048 --pp 8 --steps 10]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's robust_metrics, installed or not
ST = ROOT / "tests" / "fixtures" / "whatif-ST"


def naive_analysis(model) -> dict:  # type: ignore[no-untyped-def]
    """The same numbers as analyze(), every scenario run by the naive per-op simulator."""
    from robust_metrics.analysis.whatif import optypes as T
    from robust_metrics.analysis.whatif.analysis import ideal_durations
    from robust_metrics.analysis.whatif.naive import simulate_naive

    g = model.graph
    shape = model.duration.shape
    ideal_d, ideal_x = (np.broadcast_to(a, shape) for a in ideal_durations(model))

    def run(mask: np.ndarray, restore: bool) -> float:
        if restore:
            d = np.where(mask, model.duration, ideal_d)
            x = np.where(mask, model.transfer, ideal_x)
        else:
            d = np.where(mask, ideal_d, model.duration)
            x = np.where(mask, ideal_x, model.transfer)
        return float(simulate_naive(g, d, x).mean())

    none = np.zeros((g.n_ops, 1, 1), dtype=bool)
    t_ori, t_ideal = run(none, False), run(none, True)
    stage = model.op_stage
    folded = np.array([T.fold_optype(t) for t in model.op_type])
    dp_mask = np.arange(model.dp)[None, :, None]
    by_dp = {d: run(np.broadcast_to(dp_mask == d, (g.n_ops, model.dp, 1)), True) / t_ideal
             for d in range(model.dp)}
    by_stage = {int(s): run((stage == s)[:, None, None], True) / t_ideal for s in set(stage)}
    by_type = {k: run((folded == k)[:, None, None], True) / t_ideal for k in set(folded)}
    last = (stage == stage.max())[:, None, None]
    ms = (t_ori - run(last, False)) / (t_ori - t_ideal)
    heat = {(d, s): min(by_dp[d], by_stage[s]) for d in by_dp for s in by_stage}
    n_top = math.ceil(len(heat) * 0.03)
    top = sorted(heat, key=lambda k: (-heat[k], model.rank_of[k]))[:n_top]
    worker = np.zeros((g.n_ops, model.dp, 1), dtype=bool)
    for d, s in top:
        worker[stage == s, d] = True
    mw = (t_ori - run(worker, False)) / (t_ori - t_ideal)
    run(last, True)
    run(worker, True)  # the "add" halves, as analyze() computes them too
    return {"slowdown": t_ori / t_ideal, "ms": ms, "mw": mw, "by_stage": by_stage,
            "by_optype": by_type}


def _case(name: str, trace: str, meta: str | None, naive: bool, queue: mp.Queue) -> None:
    from robust_metrics.analysis.whatif import analyze, load_model

    began = time.perf_counter()
    model = load_model(trace, meta)
    loaded = time.perf_counter()
    if naive:
        result = naive_analysis(model)
        figures = {"slowdown": result["slowdown"], "ms": result["ms"], "mw": result["mw"]}
    else:
        r = analyze(model)
        figures = {"slowdown": r.slowdown, "ms": r.ms, "mw": r.mw}
    done = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    queue.put({"case": name, "load_s": loaded - began, "analysis_s": done - loaded,
               "total_s": done - began, "peak_rss_mib": rss, "ranks": int(model.rank_of.size),
               "steps": len(model.steps), "ops": model.graph.n_ops, **figures})


def measure(name: str, trace: str, meta: str | None = None, naive: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_case, args=(name, trace, meta, naive, queue))
    proc.start()
    result = queue.get(timeout=3600)
    proc.join(timeout=60)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-large", action="store_true")
    p.add_argument("--dp", type=int, default=2048)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    args = p.parse_args()
    rows = []
    trace, meta = str(ST / "trace-ST.parquet"), str(ST / "meta-ST.yaml")
    rows.append(measure("fixture ST, vectorised", trace, meta))
    rows.append(measure("fixture ST, naive per-op", trace, meta, naive=True))
    if not args.skip_large:
        from bench.synthetic_trace import SyntheticJob, generate

        with tempfile.TemporaryDirectory() as tmp:
            began = time.perf_counter()
            job = SyntheticJob(dp=args.dp, pp=args.pp, steps=args.steps,
                               microbatches=args.microbatches, worker_factor={(7, 3): 1.5})
            path = Path(tmp) / "large.parquet"
            generate(job).to_parquet(path)
            print(f"generated {args.dp * args.pp} ranks x {args.steps} steps in "
                  f"{time.perf_counter() - began:.1f} s ({path.stat().st_size / 2**20:.0f} MiB)")
            rows.append(measure(f"synthetic {args.dp * args.pp} ranks x {args.steps} steps",
                                str(path)))
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    base = rows[0]["analysis_s"]
    print(f"naive / vectorised analysis time on ST: {rows[1]['analysis_s'] / base:.1f}x")


if __name__ == "__main__":
    main()
