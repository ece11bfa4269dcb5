"""`robust-metrics whatif` and `robust-metrics stacks` on hostile input: a one-line error and
exit 2, never a traceback, never minutes of work or gigabytes of memory."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.synthetic_trace import SyntheticJob, generate
from robust_metrics.analysis.flight_recorder import analyse_dumps, load_dump
from robust_metrics.analysis.stacks import analyse
from robust_metrics.analysis.stacks_cli import format_report
from robust_metrics.analysis.whatif.cli import parse_steps
from robust_metrics.cli import main
from robust_metrics.rankfolder.identity import rank_info

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def run_cli(*args: str) -> tuple[int, str]:
    """(exit status, stderr) of the command run in-process; SystemExit from argparse included."""
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, err.getvalue()


def assert_clear_error(code: int, err: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("robust-metrics "), err


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("whatif")
    path = folder / "ok.jsonl"
    generate(SyntheticJob(dp=2, pp=2, seed=2)).to_json(path, orient="records", lines=True)
    return path


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_whatif_bad_inputs_are_one_line_errors(trace: Path, tmp_path: Path) -> None:
    rows = [json.loads(line) for line in trace.read_text().splitlines()[:40]]
    huge = _jsonl(tmp_path / "huge.jsonl", [{**rows[0], "step": 10**31}, *rows[1:]])
    binary = tmp_path / "meta.bin"
    binary.write_bytes(b"\x00\xff\xfe garbage")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("1: 2\ndp_size: 2\n")
    ok = str(trace)
    cases = [
        [huge],
        [ok, "--meta", str(binary)],
        [ok, "--meta", str(tmp_path)],
        [ok, "--meta", str(mixed)],
        [ok, "--steps", "0-1e11"],
        [ok, "--threshold", "nan"],
        [ok, "--threshold", "inf"],
    ]
    for case in cases:
        code, err = run_cli("whatif", *case, "--no-progress")
        assert_clear_error(code, err)


def test_a_range_of_10_to_the_11_steps_costs_nothing(trace: Path) -> None:
    steps = parse_steps("0-100000000000")
    assert 99_999_999_999 in steps and 100_000_000_001 not in steps
    code, err = run_cli("whatif", str(trace), "--steps", "0-100000000000", "--json",
                        "--no-progress")
    assert code == 0, err


@given(st.text(alphabet="0123456789-,e. x", max_size=30))
@FAST
def test_steps_specs_parse_or_are_refused(spec: str) -> None:
    try:
        steps = parse_steps(spec)
    except ValueError as exc:
        assert str(exc).startswith("--steps: ")
        return
    assert all(lo <= hi for lo, hi in steps.ranges)


@pytest.mark.parametrize("args", [
    ["--pid", "0"], ["--pid", "-3"], ["--pid", str(10**20)], ["--pid", "1", "--samples",
                                                              str(10**20)],
    ["--pid", "1", "--interval", "nan"], ["--pid", "1", "--timeout", "inf"],
    ["--pid", "1", "--min-share", "nan"],
])
def test_stacks_bad_numbers_are_usage_errors(args: list[str]) -> None:
    code, err = run_cli("stacks", *args)
    assert code == 2 and "Traceback" not in err and "error: argument" in err


def test_stacks_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "bad_0.json").write_text('{"entries": [1, 2], "rank": 0}')
    (tmp_path / "md" / "ranks").mkdir(parents=True)
    (tmp_path / "md" / "ranks" / "1.json").write_text('{"run": "r", "rank": [1]}')
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe\x00")
    for args in (["--pid", "1", "--samples", "1", "--flight-recorder",
                  str(tmp_path / "fr" / "bad_0.json")],
                 ["--metrics-dir", str(tmp_path / "md")],
                 ["--metrics-dir", str(token)],
                 ["http://127.0.0.1:1", "--token-file", str(token)]):
        assert_clear_error(*run_cli("stacks", *args))


def test_stacks_reads_a_folder_whose_ranks_are_named_with_any_label(tmp_path: Path) -> None:
    """A job writes its identity: a rank label that is no rank number ('²' passed
    str.isdigit() and int() refused it, 'abc', 5,000 digits) made `stacks --metrics-dir` stop
    with int()'s error instead of reporting the folder."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for pid, rank in ((4001, "\u00b2"), (4002, "abc"), (4003, "9" * 5000)):
        (ranks / f"{pid}.json").write_text(json.dumps({"run": "r", "rank": rank}))
    code, err = run_cli("stacks", "--metrics-dir", str(tmp_path))
    assert code == 3 and "Traceback" not in err and "int()" not in err, err


# -- fuzzing the parts that read what other machines sent -----------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
frames = st.lists(st.fixed_dictionaries({"function": json_values, "file": json_values,
                                         "line": json_values}), max_size=3)
threads = st.lists(st.fixed_dictionaries({"thread_name": json_values, "idle": json_values,
                                          "frames": frames | json_values}), max_size=3)
entries = st.lists(st.fixed_dictionaries(
    {"rank": json_values, "pid": json_values, "run": st.just("r") | json_values,
     "node": json_values, "dp_rank": json_values, "threads": threads | json_values,
     "error": json_values}), max_size=4)


def _dump(**fields: Any) -> dict[str, Any]:
    return {"rank": None, "pid": None, "run": "r", "node": None, "dp_rank": None,
            "threads": [], "error": None, **fields}


@given(entries)
# a pid or rank that JSON can carry but no process has: int() of an infinity raised
# OverflowError (found by this test), of a fraction it truncated to another process' number
@example([_dump(), _dump(pid=math.inf)])
@example([_dump(rank=-math.inf), _dump(pid=math.nan)])
@example([_dump(rank=1.5, pid=2.5), _dump(rank=1e308)])
@FAST
def test_sidecar_answers_of_any_shape_analyse_or_raise_value_error(
        dumps: list[dict[str, Any]]) -> None:
    try:
        report = analyse(dumps, rank_info(d for d in dumps if isinstance(d, dict)))
    except ValueError:
        return
    format_report(report)


fr_entries = st.lists(st.fixed_dictionaries(
    {"process_group": json_values, "collective_seq_id": json_values,
     "profiling_name": json_values, "is_p2p": json_values}) | json_values, max_size=4)
fr_dumps = st.fixed_dictionaries({"entries": fr_entries, "rank": json_values,
                                  "pg_status": json_values, "pg_config": json_values})


@given(fr_dumps)
@FAST
def test_flight_recorder_dumps_of_any_shape_load_or_raise_value_error(
        tmp_path_factory: pytest.TempPathFactory, dump: dict[str, Any]) -> None:
    path = tmp_path_factory.mktemp("fr") / "dump_3.json"
    path.write_text(json.dumps(dump))
    try:
        rank, loaded = load_dump(str(path))
    except ValueError:
        return
    analyse_dumps({rank: loaded})
