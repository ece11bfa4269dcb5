from __future__ import annotations

import pytest

pytest_plugins = ["tests.process_check", "tests.module_order"]


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
