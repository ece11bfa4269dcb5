from __future__ import annotations

import pytest

from robust_metrics import processes

pytest_plugins = ["tests.process_check", "tests.module_order"]

# The suite starts about 200 gloo ranks: forked from one launcher per job that imported these
# once (robust_metrics/forked_ranks.py), each saves the 2-3 CPU-seconds of importing them.
processes.RANK_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel",
                          "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                          "torch.distributed.pipelining", "robust_metrics.hooks")


def _gpu_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (NVML did not initialise)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
