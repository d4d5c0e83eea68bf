"""Peak figures of known accelerators, for estimating time on the meta device (`profile_meta`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one accelerator, for time estimates without the hardware."""

    name: str
    memory_bytes: int
    flops: dict[str, float]
    """Dense peak FLOP/s per dtype name (``bfloat16``, ``float16``, ``float32``)."""
    hbm_bytes_per_s: float
    host_bytes_per_s: float
    """Host link bandwidth (PCIe or C2C), for ``offload`` copies."""


_MIB = 1 << 20
HARDWARE: dict[str, Hardware] = {
    # Datasheet dense peaks; fp32 without TF32 (PyTorch's default); host: effective pinned-copy throughput.
    "A100": Hardware(
        "A100-SXM4-80GB", 81920 * _MIB, {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}, 2.039e12, 25e9
    ),
    "H100": Hardware(
        "H100-SXM5-80GB", 81559 * _MIB, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 3.35e12, 50e9
    ),
    "H200": Hardware(
        "H200-SXM-141GB", 143771 * _MIB, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 4.8e12, 50e9
    ),
    "L4": Hardware("L4-24GB", 23034 * _MIB, {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12}, 300e9, 25e9),
}
