"""Reading traces: parquet, JSON lines, or a folder of JSON-lines files (one per rank).

The columns are those of the op trace format (`robust_metrics/optrace.py`, docs/whatif.md).
Problems are reported as `TraceError` with the file and column or row at fault, because a
what-if result computed from a half-read trace is worse than none.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from robust_metrics.analysis.whatif import optypes as T
from robust_metrics.optrace import COLUMNS

__all__ = ["COLUMNS", "TraceError", "read_trace", "validate"]


class TraceError(ValueError):
    """A trace that cannot be analysed; the message says which file, column or op."""


def _read_jsonl(path: Path) -> pd.DataFrame:
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not a JSON object: {exc}") from None
    return pd.DataFrame.from_records(rows)


def read_trace(path: str | Path) -> pd.DataFrame:
    """Read and validate a trace file or folder; return a DataFrame with `COLUMNS` typed."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace {path} does not exist")
    if path.is_dir():
        files = sorted([*path.glob("*.jsonl"), *path.glob("*.parquet")])
        if not files:
            raise TraceError(f"trace folder {path} holds no *.jsonl or *.parquet files")
        frames = [read_trace(f) for f in files]
        return validate(pd.concat(frames, ignore_index=True), source=str(path))
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    try:
        if suffix == ".parquet":  # optype as a dictionary: millions of rows share 14 strings
            import pyarrow.parquet as pq

            table = pq.read_table(path, read_dictionary=["optype"])
            df = table.to_pandas(self_destruct=True, split_blocks=True)
            del table
        elif suffix in (".jsonl", ".json", ".jsonl.gz", ".ndjson"):
            df = (pd.read_json(path, lines=True) if suffix.endswith(".gz")
                  else _read_jsonl(path))
        else:
            raise TraceError(f"trace {path}: unknown format {suffix!r}; use .parquet or .jsonl")
    except TraceError:
        raise
    except Exception as exc:  # pyarrow and pandas raise many types for a broken file
        raise TraceError(f"trace {path} could not be read: {exc}") from None
    return validate(df, source=str(path))


def validate(df: pd.DataFrame, *, source: str = "trace") -> pd.DataFrame:
    """Check columns, types and values; return a copy with canonical dtypes."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise TraceError(f"{source}: missing column(s) {', '.join(missing)}; a trace needs "
                         f"{', '.join(COLUMNS)}")
    if len(df) == 0:
        raise TraceError(f"{source}: the trace has no rows")
    out = pd.DataFrame(index=df.index)
    for col, dtype in COLUMNS.items():
        values = df[col]
        if values.isna().any():
            row = int(np.flatnonzero(values.isna().to_numpy())[0])
            raise TraceError(f"{source}: column {col} is empty in row {row}")
        if dtype == "str":
            if not isinstance(values.dtype, pd.CategoricalDtype):
                values = values.astype(str).astype("category")
            out[col] = values.cat.rename_categories([str(c) for c in values.cat.categories])
            continue
        try:
            out[col] = pd.to_numeric(values).astype(dtype)
        except (TypeError, ValueError):
            raise TraceError(f"{source}: column {col} must be numeric") from None
        except OverflowError:
            raise TraceError(f"{source}: column {col} has a number too large for {dtype}"
                             ) from None
    unknown = sorted(set(map(str, out["optype"].unique())) - set(T.OPTYPES))
    if unknown:
        raise TraceError(f"{source}: unknown optype(s) {', '.join(unknown)}; known: "
                         f"{', '.join(T.OPTYPES)}")
    for col in ("dp_rank", "stage", "rank", "seq_id"):
        if (out[col] < 0).any():
            raise TraceError(f"{source}: column {col} has negative values")
    if (out["duration"] < 0).any() or not np.isfinite(out["duration"]).all():
        raise TraceError(f"{source}: column duration has negative or non-finite values")
    if not np.isfinite(out["start_ts"]).all():
        raise TraceError(f"{source}: column start_ts has non-finite values")
    return out.reset_index(drop=True)
