"""`robust-metrics stacks` input handling: sources, URLs, tokens, bad flags (no processes)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from robust_metrics import cli
from robust_metrics.analysis.stacks_cli import _ranges, format_report
from robust_metrics.analysis.stacks_sources import SourceError, identities_from_dir, stacks_url
from tests.support import free_port


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli.main(["stacks", *args])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_sidecar_urls_are_normalised() -> None:
    assert stacks_url("http://n1:9741") == "http://n1:9741/debug/stacks"
    assert stacks_url("n1:9741/") == "http://n1:9741/debug/stacks"
    assert stacks_url("https://n1:9741/metrics") == "https://n1:9741/debug/stacks"
    assert stacks_url("http://n1/rm/debug/stacks?x=1") == "http://n1/rm/debug/stacks"
    with pytest.raises(SourceError, match="not an http"):
        stacks_url("ftp://n1:9741")


@pytest.mark.parametrize("args, message", [
    ((), "exactly one source"),
    (("--pid", "1", "--metrics-dir", "/tmp"), "exactly one source"),
    (("--prometheus", "prometheus:9090"), "http(s) URL"),
    (("--metrics-dir", "/nonexistent-dir"), "no ranks/ folder"),
])
def test_bad_sources_exit_2_with_a_message(args: tuple[str, ...], message: str) -> None:
    code, out, err = run(*args)
    assert code == 2 and message in err and out == ""


def test_bad_numbers_are_refused_by_the_parser() -> None:
    for flag, value in (("--samples", "0"), ("--interval", "-1"), ("--min-share", "1.5"),
                        ("--pid", "abc")):
        code, _, err = run("--pid", "1", flag, value)
        assert code == 2 and flag in err


def test_empty_token_file_is_bad_input(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n")
    code, _, err = run("http://127.0.0.1:1", "--token-file", str(token))
    assert code == 2 and "empty" in err


def test_unreachable_sidecar_only_gives_exit_3_and_the_reason() -> None:
    port = free_port()
    code, out, _ = run(f"http://127.0.0.1:{port}", "--samples", "1", "--json")
    assert code == 3
    report = json.loads(out)
    assert report["ranks_analysed"] == 0
    assert "cannot reach" in report["errors"][0]["error"]


def test_identity_files_skip_broken_ones_and_filter_by_run(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    (ranks / "11.json").write_text(json.dumps({"run": "a", "rank": 0, "pid": 11}))
    (ranks / "12.json").write_text(json.dumps({"run": "b", "rank": 0, "pid": 12}))
    (ranks / "13.json").write_text("{half-written")
    assert set(identities_from_dir(str(tmp_path))) == {11, 12}
    assert set(identities_from_dir(str(tmp_path), "b")) == {12}
    code, _, err = run("--metrics-dir", str(tmp_path))  # two runs, none chosen
    assert code == 2 and "several runs" in err


def test_rank_ranges_and_text_report() -> None:
    assert _ranges([0, 1, 2, 3, 5, 7, 8, 9]) == "0-3, 5, 7-9"
    assert _ranges(["pid:4@?"]) == "pid:4@?"
    report = {"run": "r", "ranks_analysed": 3, "samples": 2, "hung": True,
              "stable_ranks": [0, 1, 2], "nodes": ["n1"], "topology": {}, "errors": [],
              "notes": [], "missing_ranks": [],
              "suspects": [{"ident": 2, "rank": 2, "node": "n1", "pid": 9, "local_rank": 0,
                            "dp_rank": 1, "pp_rank": None, "tp_rank": None,
                            "reasons": ["main thread in f (x.py)"], "main_frames": []}],
              "groups": [{"role": "main", "signature": ["g (y.py)"], "ranks": [0, 1],
                          "count": 2, "healthy": True, "state": "stuck"}]}
    text = format_report(report)
    assert "job hung" in text
    assert "rank 2 on node n1 (pid 9, local_rank 0, dp 1)" in text
    assert "main: 2 rank(s) healthy stuck: 0-1" in text
