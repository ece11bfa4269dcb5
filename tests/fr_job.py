"""Gloo ranks that write Flight Recorder JSON while one of them skips the last all_reduce.

Every rank runs three all_reduces; then all but `--skip-rank` launch a fourth one asynchronously
(it can never complete) and every rank writes `torch._C._distributed_c10d._dump_fr_trace_json()`
to `OUT/fr_rank<R>.json` and exits without waiting, as the NCCL watchdog's dump would capture it.
Needs TORCH_FR_BUFFER_SIZE set in the environment.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace_json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip-rank", type=int, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    if rank != args.skip_rank:
        dist.all_reduce(torch.ones(4), async_op=True)
    data = _dump_fr_trace_json(True, True)
    with open(os.path.join(args.out, f"fr_rank{rank}.json"), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    print(f"rank {rank}: dumped", flush=True)
    os._exit(0)  # the unmatched all_reduce would block a clean shutdown


if __name__ == "__main__":
    main()
