"""The node self-test's communication check on real gloo ranks: three local ranks, and three
`robust-metrics selftest` processes joined as one group per node, each with a slowed link on one
rank that the check names. The other checks: tests/test_selftest.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from robust_metrics.selftest import communication


def test_a_slowed_rank_is_named_among_three_local_gloo_ranks() -> None:
    # Three ranks share two busy cores here, so a healthy pair can be descheduled for a few ms;
    # the fraction is set where that noise cannot reach and a 0.5 s delay per transfer is far below.
    options = communication.CommunicationOptions(world_size=3, size_bytes=256 << 10, iterations=2,
                                                 min_pair_fraction=0.02, timeout_s=60)
    healthy = communication.run(options)
    slowed = communication.run(options, {"rank": "1", "delay": "0.5"})
    assert healthy.verdict == "pass", healthy.detail
    assert healthy.figure and healthy.figure > 0 and len(healthy.data["pairs"]) == 3
    assert slowed.verdict == "fail", slowed.detail
    assert slowed.data["culprit_ranks"] == [1]
    assert slowed.detail.startswith("rank 1 (")


def test_one_rank_per_node_from_the_environment_blames_only_the_slow_node(tmp_path: Path) -> None:
    """Three `robust-metrics selftest --check communication` processes joined as a multi-node
    group through MASTER_ADDR/WORLD_SIZE/RANK, as a prolog on three nodes would run them; rank 2
    has a slowed link: only its process fails, and every process names it."""
    import subprocess

    from tests.support import ROOT, free_port

    port = str(free_port())
    procs = []
    for rank in range(3):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "3",
               "RANK": str(rank), "OMP_NUM_THREADS": "1",
               "ROBUST_SELFTEST_FAULT": "communication:rank=2;delay=0.5"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "robust_metrics", "selftest", "--check", "communication",
             "--json", "--node", f"node{rank}", "--comm-bytes", "262144", "--iterations", "2",
             "--min-pair-fraction", "0.02", "--comm-timeout", "60"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = [json.loads(out) for out, _ in outs]
    assert [p.returncode for p in procs] == [0, 0, 1], [err[-500:] for _, err in outs]
    for rank, report in enumerate(reports):
        (result,) = report["results"]
        assert result["data"]["rank"] == rank
        assert result["data"]["nodes"] == ["node0", "node1", "node2"]
        assert result["data"]["culprit_ranks"] == [2]
    assert reports[2]["results"][0]["detail"].startswith("rank 2 (node2) is in every slow pair")
