"""Which nodes a self-test blames: each node's own verdict, then the run's nodes held against
each other. Pure functions over the sidecars' reports, no HTTP, so the bridge's `selftest` step
and its tests share them.

A node judges itself against its own history; the bridge sees every node of the run at once, so
it can also judge them against each other, as a fleet does: with three or more nodes, a compute
digest that differs from the one a strict majority computed (same seed, size and request) is
silent data corruption on that node, and FLOP/s below `min_fraction` of the run's median is a
slow node. With two nodes a difference cannot say which one is wrong, so nothing is blamed.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["node_verdict", "peer_outliers"]


def node_verdict(report: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a node's report the ledger keeps: verdict, failed checks, why, and the
    compute figures the nodes are compared by."""
    results = [r for r in report.get("results") or [] if isinstance(r, Mapping)]
    compute = next((r for r in results if r.get("check") == "compute"), None)
    out: dict[str, Any] = {
        "verdict": str(report.get("verdict")),
        "failed": [str(r.get("check")) for r in results if r.get("verdict") == "fail"],
        "detail": "; ".join(f"{r.get('check')}: {r.get('detail')}" for r in results
                            if r.get("verdict") == "fail"),
    }
    if compute is not None and compute.get("verdict") != "skipped":
        out["digest"] = (compute.get("data") or {}).get("digest")
        out["flops"] = compute.get("figure")
    return out


def peer_outliers(verdicts: Mapping[str, Mapping[str, Any]],
                  min_fraction: float = 0.5) -> dict[str, str]:
    """node -> why, for the nodes the others outvote (digest) or outrun (FLOP/s)."""
    out: dict[str, str] = {}
    digests = {n: v["digest"] for n, v in verdicts.items() if v.get("digest")}
    if len(digests) >= 3:
        common, votes = Counter(digests.values()).most_common(1)[0]
        if votes * 2 > len(digests):
            for node, digest in digests.items():
                if digest != common:
                    out[node] = (f"compute digest {digest[:16]}... differs from the "
                                 f"{votes} of {len(digests)} nodes that computed "
                                 f"{common[:16]}...: silent data corruption")
    flops = {n: float(v["flops"]) for n, v in verdicts.items() if v.get("flops")}
    if len(flops) >= 3:
        median = statistics.median(flops.values())
        for node, value in flops.items():
            if value < min_fraction * median and node not in out:
                out[node] = (f"compute {value / 1e9:.1f} GFLOP/s is below {min_fraction:g} x "
                             f"the run's median ({median / 1e9:.1f} GFLOP/s)")
    return out
