"""The heatmap PNG: DP rank x stage, each cell min(S_dp, S_stage), as in the straggler study.

A bright column is a slow DP rank, a bright row a slow stage, a single bright cell one slow worker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from robust_metrics.analysis.whatif.analysis import WhatIfResult

__all__ = ["write_heatmap"]


def write_heatmap(result: WhatIfResult, path: str | Path) -> Path:
    """Write the heatmap; raises ValueError when the result has no attribution (S < threshold)."""
    if result.heatmap is None:
        raise ValueError("no attribution was computed (S is below the threshold), so there is "
                         "no heatmap to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = np.asarray(result.heatmap).T  # rows: stages, columns: DP ranks
    stages, dps = cells.shape
    width = min(16.0, max(3.0, 0.5 * dps + 1.5))
    height = min(12.0, max(2.0, 0.5 * stages + 1.2))
    fig, ax = plt.subplots(figsize=(width, height))
    vmax = max(1.5, float(cells.max()))
    image = ax.imshow(cells, cmap="Reds", vmin=1.0, vmax=vmax, aspect="auto",
                      interpolation="nearest")
    if dps * stages <= 400:
        for s in range(stages):
            for d in range(dps):
                ax.text(d, s, f"{cells[s, d]:.2f}", ha="center", va="center", fontsize=8)
    if dps <= 64:
        ax.set_xticks(range(dps))
    if stages <= 64:
        ax.set_yticks(range(stages))
    ax.set_xlabel("DP rank")
    ax.set_ylabel("PP stage")
    ax.set_title(f"what-if slowdown S = {result.slowdown:.3f}")
    fig.colorbar(image, ax=ax, label="min(S_dp, S_stage)")
    path = Path(path)
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)
    return path
