"""`robust-metrics whatif`: summary, --json, --out files, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.synthetic_trace import SyntheticJob, generate
from robust_metrics.cli import main

ST = Path(__file__).parent / "fixtures" / "whatif-ST"
TRACE, META = str(ST / "trace-ST.parquet"), str(ST / "meta-ST.yaml")


def test_json_output_has_the_documented_keys(capsys):
    assert main(["whatif", TRACE, "--meta", META, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("slowdown", "step_slowdown", "by_dp_rank", "by_stage", "by_optype", "mw", "ms",
                "t_original", "t_ideal"):
        assert key in doc, key
    assert abs(doc["slowdown"] - 1.1787) < 0.01
    assert next(iter(doc["by_stage"])) == "3"
    assert len(doc["step_slowdown"]) == 32
    assert doc["by_optype"]["forward-pp-comm"] < 1.01


def test_summary_names_the_heavy_last_stage(capsys):
    assert main(["whatif", TRACE, "--meta", META]) == 0
    out = capsys.readouterr().out
    assert "S = 1.1787" in out
    assert "stage 3: 1.2323" in out
    assert "heavy last pipeline stage" in out


def test_out_writes_json_heatmap_and_timeline(tmp_path, capsys):
    assert main(["whatif", TRACE, "--out", str(tmp_path), "--timeline-steps", "1"]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["heatmap"][1][3] == min(result["by_dp_rank"]["1"], result["by_stage"]["3"])
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    spans = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
    n_rows = 6784 // 32  # ops of one step, all ranks
    assert len(spans) == 2 * n_rows  # original and ideal
    assert {e["pid"] for e in spans} == {1, 2}
    assert all(e["dur"] >= 0 for e in spans)


def test_no_straggler_summary_says_so(tmp_path, capsys):
    generate(SyntheticJob(dp=2, pp=2, seed=2)).to_parquet(tmp_path / "t.parquet")
    assert main(["whatif", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "no straggling worth attributing" in out
    assert not (tmp_path / "o" / "heatmap.png").exists()


def test_bad_input_exits_2_with_a_message(tmp_path, capsys):
    df = generate(SyntheticJob(dp=2, pp=2)).drop(columns=["duration"])
    df.to_parquet(tmp_path / "t.parquet")
    assert main(["whatif", str(tmp_path / "t.parquet")]) == 2
    assert "missing column(s) duration" in capsys.readouterr().err
    assert main(["whatif", str(tmp_path / "nope.parquet")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["whatif", TRACE, "--pp-size", "3"]) == 2
    assert "pp_size=3" in capsys.readouterr().err


def test_console_entry_point_runs_as_a_process():
    proc = subprocess.run([sys.executable, "-m", "robust_metrics.cli", "whatif", TRACE, "--json",
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ms"] > 1.0


def test_steps_selects_steps(capsys):
    assert main(["whatif", TRACE, "--json", "--steps", "23-33,1048"]) == 0
    assert set(json.loads(capsys.readouterr().out)["step_slowdown"]) == {"23", "25", "33", "1048"}
    assert main(["whatif", TRACE, "--steps", "9-3"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["whatif", TRACE, "--steps", "1-2"]) == 2
    assert "none of the requested steps" in capsys.readouterr().err


UNTRACED = str(Path(__file__).parent / "fixtures" / "whatif-untraced")


def test_low_coverage_warns_and_blames_nobody(capsys):
    assert main(["whatif", UNTRACED, "--steps", "2-100"]) == 0
    out = capsys.readouterr().out
    assert "coverage = 0.1" in out and "WARNING: the traced ops explain only" in out
    assert "top ranks" not in out and "nothing can be attributed" in out
    assert main(["whatif", UNTRACED, "--steps", "2-100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["coverage"] < 0.2 and doc["by_dp_rank"] is None and len(doc["warnings"]) == 1
    # the gate can be lowered on purpose
    assert main(["whatif", UNTRACED, "--steps", "2-100", "--min-coverage", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["by_dp_rank"] is not None and doc["warnings"] == []


def test_bad_min_coverage_is_exit_2(capsys):
    for value in ("1.5", "-0.1", "nan"):
        assert main(["whatif", TRACE, "--min-coverage", value]) == 2, value
        assert "--min-coverage must be a fraction" in capsys.readouterr().err
