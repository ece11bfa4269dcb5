"""GPU peak FLOP/s by NVML name (the MFU denominator), its overrides, and a real GPU's name."""

from __future__ import annotations

import pytest

from robust_metrics.configuration import ConfigError
from robust_metrics.sidecar.config import SidecarConfig
from robust_metrics.sidecar.gpu_peaks import parse_overrides, peak_flops


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989),
    ("NVIDIA H100 PCIe", "bf16", 756),
    ("NVIDIA H100 NVL", "fp8", 1670),
    ("NVIDIA H200", "bf16", 989),
    ("NVIDIA H200 NVL", "bf16", 835),
    ("NVIDIA H800", "bf16", 989),
    ("NVIDIA GH200 480GB", "bf16", 989),
    ("NVIDIA B200", "bf16", 2250),
    ("NVIDIA GB200", "fp8", 5000),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312),
    ("NVIDIA A100 80GB PCIe", "tf32", 156),
    ("NVIDIA A800-SXM4-80GB", "bf16", 312),
    ("NVIDIA A10", "bf16", 125),
    ("NVIDIA A30", "bf16", 165),
    ("NVIDIA L40S", "bf16", 362),
    ("NVIDIA L40", "bf16", 181),
    ("NVIDIA L4", "bf16", 121),
    ("Tesla V100-SXM2-32GB", "fp16", 125),
    ("Tesla V100-PCIE-16GB", "fp16", 112),
    ("Tesla T4", "fp16", 65),
])
def test_common_gpus_have_their_dense_peak(name: str, dtype: str, tflops: float) -> None:
    assert peak_flops(name, dtype) == tflops * 1e12


@pytest.mark.parametrize(("name", "dtype"), [
    ("NVIDIA A10G", "bf16"),  # not A10: a different part, not in the table
    ("Tesla V100-SXM2-32GB", "bf16"),  # no bf16 on Volta
    ("NVIDIA GeForce RTX 4090", "bf16"),
    ("", "bf16"),
])
def test_unknown_gpus_or_precisions_have_no_peak(name: str, dtype: str) -> None:
    assert peak_flops(name, dtype) is None


def test_overrides_win_over_the_table_by_name_part() -> None:
    overrides = parse_overrides(["a10g=70e12", "H100=900e12"])
    assert peak_flops("NVIDIA A10G", "bf16", overrides) == 70e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", overrides) == 900e12
    assert peak_flops("NVIDIA L4", "bf16", overrides) == 121e12
    assert peak_flops("anything", "fp32", parse_overrides(["*=1e12"])) == 1e12


@pytest.mark.parametrize(("value", "message"), [
    ("H100", "expected NAME=FLOPS"),
    ("=1e12", "expected NAME=FLOPS"),
    ("H100=fast", "'fast' is not a number"),
    ("H100=-1", "must be a number > 0"),
    ("H100=inf", "must be a number > 0"),
])
def test_bad_overrides_are_config_errors(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SidecarConfig(directory="/tmp", gpu_peak_flops=[value]).validate()


def test_an_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--gpu-peak-dtype 'int4'"):
        SidecarConfig(directory="/tmp", gpu_peak_dtype="int4").validate()


@pytest.mark.gpu
def test_the_real_gpus_names_map_to_a_peak() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError: no driver here
        pytest.skip(f"no NVML: {exc}")
    try:
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    if not names:
        pytest.skip("NVML sees no GPU")
    for raw in names:
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        assert peak_flops(name, "bf16") or peak_flops(name, "fp16"), f"{name!r} not in the table"
        print(f"{name}: bf16 peak {peak_flops(name, 'bf16')}")
