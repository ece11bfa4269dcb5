"""Peak FLOP/s of common GPUs by their NVML name: the denominator of MFU.

Values are the vendor's dense tensor-core peaks (no 2:4 sparsity) of the SXM/OAM part unless the
name says PCIe or NVL, in TFLOP/s, per precision. MFU papers (PaLM, Megatron) divide achieved model
FLOP/s by the dense peak of the precision the matmuls run in, which for today's training is bf16:
the sidecar's default `--gpu-peak-dtype bf16`. A GPU missing from the table, or without the chosen
precision (a V100 has no bf16), publishes no peak; `--gpu-peak-flops NAME=FLOPS` (NAME a
case-insensitive part of the NVML name, or `*`) sets or corrects one, and wins over the table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from robust_metrics.configuration import ConfigError

__all__ = ["DTYPES", "PEAK_TFLOPS", "parse_overrides", "peak_flops"]

DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")

# (pattern on the upper-cased NVML name, {dtype: dense TFLOP/s}); the first match wins, so a
# variant (PCIe, NVL) comes before its family.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bGB200\b", {"bf16": 2500, "fp16": 2500, "fp8": 5000, "tf32": 1250}),
    (r"\bB200\b", {"bf16": 2250, "fp16": 2250, "fp8": 4500, "tf32": 1100}),
    (r"\bB100\b", {"bf16": 1750, "fp16": 1750, "fp8": 3500, "tf32": 875}),
    (r"\bH200\b.*\bNVL\b", {"bf16": 835, "fp16": 835, "fp8": 1670, "tf32": 417, "fp32": 60}),
    (r"\bH200\b", {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 495, "fp32": 67}),
    (r"\bH100\b.*\bPCIE\b", {"bf16": 756, "fp16": 756, "fp8": 1513, "tf32": 378, "fp32": 51}),
    (r"\bH100\b.*\bNVL\b", {"bf16": 835, "fp16": 835, "fp8": 1670, "tf32": 417, "fp32": 60}),
    (r"\bH(100|800)\b", {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 495, "fp32": 67}),
    (r"\bGH200\b", {"bf16": 989, "fp16": 989, "fp8": 1979, "tf32": 495, "fp32": 67}),
    (r"\bA(100|800)\b", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bA30\b", {"bf16": 165, "fp16": 165, "tf32": 82, "fp32": 10.3}),
    (r"\bA10\b", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL40S\b", {"bf16": 362, "fp16": 362, "fp8": 733, "tf32": 183, "fp32": 91.6}),
    (r"\bL40\b", {"bf16": 181, "fp16": 181, "fp8": 362, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121, "fp16": 121, "fp8": 242, "tf32": 60, "fp32": 30.3}),
    (r"\bV100\b.*\bPCIE\b", {"fp16": 112, "fp32": 14}),
    (r"\bV100\b", {"fp16": 125, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65, "fp32": 8.1}),
)
_COMPILED = tuple((re.compile(pattern), peaks) for pattern, peaks in PEAK_TFLOPS)


def parse_overrides(values: Iterable[str]) -> list[tuple[str, float]]:
    """`NAME=FLOPS` options into (upper-cased name part, FLOP/s); ConfigError on a bad one."""
    out = []
    for value in values:
        name, sep, number = value.rpartition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--gpu-peak-flops {value!r}: expected NAME=FLOPS, e.g. H100=989e12 "
                              "(NAME a part of the NVML name, or * for every GPU)")
        try:
            flops = float(number)
        except ValueError:
            raise ConfigError(f"--gpu-peak-flops {value!r}: {number!r} is not a number") from None
        if not math.isfinite(flops) or flops <= 0:
            raise ConfigError(f"--gpu-peak-flops {value!r}: FLOP/s must be a number > 0")
        out.append((name.strip().upper(), flops))
    return out


def peak_flops(name: str, dtype: str = "bf16",
               overrides: Sequence[tuple[str, float]] = ()) -> float | None:
    """Peak FLOP/s of the GPU called `name` by NVML in `dtype`; None when unknown."""
    upper = name.upper()
    for part, flops in overrides:
        if part == "*" or part in upper:
            return flops
    for pattern, peaks in _COMPILED:
        if pattern.search(upper):
            tflops = peaks.get(dtype)
            return None if tflops is None else tflops * 1e12
    return None
