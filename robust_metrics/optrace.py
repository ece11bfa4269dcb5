"""The op trace format of the what-if analysis, writer and reader alike.

One JSON object per op and line in `trace-rank<R>.jsonl` (or the same columns in Parquet):
`dp_rank`, `stage`, `rank`, `step`, `optype`, `start_ts` (wall-clock seconds), `duration`
(seconds), `seq_id` (the op's index among ops of its type in the step), `mc`/`gmc` (model and
global model chunk, -1 for ops outside a chunk) and `mb_id` (microbatch, -1 outside one); see
docs/whatif.md. The hook (`hooks/trace.py`) writes records with `record()`; the what-if loader
(`analysis/whatif/loader.py`) checks and types them with `COLUMNS`. Nothing here imports torch
or pandas, so both ends can use it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COLUMNS", "file_name", "record"]

COLUMNS: dict[str, str] = {
    "dp_rank": "int64", "stage": "int64", "rank": "int64", "step": "int64", "optype": "str",
    "start_ts": "float64", "duration": "float64", "seq_id": "int64", "mc": "int64",
    "gmc": "int64", "mb_id": "int64",
}
"""Required columns and the dtype the reader converts each to."""


def file_name(rank: int) -> str:
    """The trace file of one rank inside the trace folder."""
    return f"trace-rank{rank}.jsonl"


def record(*, rank: int, dp_rank: int, stage: int, step: int, optype: str, start: float,
           end: float, seq_id: int, microbatch: int) -> dict[str, Any]:
    """One op as a trace row. Compute ops belong to the stage's model chunk and a microbatch;
    DDP's gradient reduction to chunk 0; anything else to neither (-1)."""
    compute = optype.endswith("-compute")
    return {"dp_rank": dp_rank, "stage": stage, "rank": rank, "step": step, "optype": optype,
            "start_ts": start, "duration": max(0.0, end - start), "seq_id": seq_id,
            "mc": 0 if compute or optype == "grads-reduce-scatter" else -1,
            "gmc": stage if compute else -1, "mb_id": microbatch if compute else -1}
