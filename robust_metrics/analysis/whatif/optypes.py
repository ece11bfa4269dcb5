"""The op types of a what-if trace and how the method treats each of them.

One table, so the loader, the dependency model, the ideal durations and the attribution agree on
which ops are compute (ideal = mean), which are communication (ideal = median), and which
synchronise across data-parallel ranks.
"""

from __future__ import annotations

__all__ = [
    "BACKWARD_COMPUTE",
    "BACKWARD_RECV",
    "BACKWARD_SEND",
    "CLIP",
    "COMM",
    "COMPUTE",
    "DP_COMM",
    "EMBEDDING_ALL_REDUCE",
    "FORWARD_COMPUTE",
    "FORWARD_RECV",
    "FORWARD_SEND",
    "GC",
    "GRADS_REDUCE_SCATTER",
    "LAYERNORM_ALL_REDUCE",
    "OPTIMIZER",
    "OPTYPES",
    "P2P",
    "PARAMS_ALL_GATHER",
    "SEPARATE_GRADS_ALL_REDUCE",
    "fold_optype",
]

FORWARD_COMPUTE = "forward-compute"
BACKWARD_COMPUTE = "backward-compute"
FORWARD_SEND = "forward-send"
FORWARD_RECV = "forward-recv"
BACKWARD_SEND = "backward-send"
BACKWARD_RECV = "backward-recv"
PARAMS_ALL_GATHER = "params-all-gather"
GRADS_REDUCE_SCATTER = "grads-reduce-scatter"
SEPARATE_GRADS_ALL_REDUCE = "separate-grads-all-reduce"
LAYERNORM_ALL_REDUCE = "layernorm-grads-all-reduce"
EMBEDDING_ALL_REDUCE = "embedding-grads-all-reduce"
CLIP = "optimizer-clip-main-grad"
OPTIMIZER = "optimizer"
GC = "gc"

P2P: tuple[str, ...] = (FORWARD_SEND, FORWARD_RECV, BACKWARD_SEND, BACKWARD_RECV)
"""Pipeline point-to-point streams, in the order the dependency model numbers them."""
DP_COMM: tuple[str, ...] = (PARAMS_ALL_GATHER, GRADS_REDUCE_SCATTER, SEPARATE_GRADS_ALL_REDUCE)
"""Data-parallel collectives: synchronise all DP ranks of a stage."""
COMPUTE: tuple[str, ...] = (FORWARD_COMPUTE, BACKWARD_COMPUTE, OPTIMIZER, GC)
"""Ops whose ideal duration is the mean of their type."""
COMM: tuple[str, ...] = (*P2P, *DP_COMM, LAYERNORM_ALL_REDUCE, EMBEDDING_ALL_REDUCE, CLIP)
"""Ops whose ideal duration and transfer time are the median of their type."""
OPTYPES: tuple[str, ...] = (*COMPUTE, *COMM)

_FOLD = {FORWARD_SEND: "forward-pp-comm", FORWARD_RECV: "forward-pp-comm",
         BACKWARD_SEND: "backward-pp-comm", BACKWARD_RECV: "backward-pp-comm"}


def fold_optype(optype: str) -> str:
    """The attribution group of an op type: the four p2p types fold into two directions."""
    return _FOLD.get(optype, optype)
