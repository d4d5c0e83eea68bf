"""Profiling without the hardware (`profile_meta`): memory on the meta device, time estimated against `HARDWARE`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_recompute import remove_policy
from lightning_recompute.layers import LayerSpec
from lightning_recompute.policy import Mode
from lightning_recompute.profile.extrapolate import extrapolated
from lightning_recompute.profile.measure import LossFn, ProfilingRun, check_modes
from lightning_recompute.profile.model import Profile, ProfileError


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one accelerator, for time estimates without the hardware."""

    name: str
    memory_bytes: int
    flops: dict[str, float]  # dense peak FLOP/s per dtype name (bfloat16, float16, float32)
    hbm_bytes_per_s: float
    host_bytes_per_s: float  # host link bandwidth (PCIe or C2C), for offload copies


# Datasheet dense peaks (half: bfloat16 and float16; float32 without TF32, PyTorch's default), memory in MiB,
# HBM bandwidth; host: effective pinned-copy throughput.
HARDWARE: dict[str, Hardware] = {
    key: Hardware(name, mib << 20, {"bfloat16": half, "float16": half, "float32": single}, hbm, host)
    for key, name, mib, half, single, hbm, host in (
        ("A100", "A100-SXM4-80GB", 81920, 312e12, 19.5e12, 2.039e12, 25e9),
        ("H100", "H100-SXM5-80GB", 81559, 989e12, 67e12, 3.35e12, 50e9),
        ("H200", "H200-SXM-141GB", 143771, 989e12, 67e12, 4.8e12, 50e9),
        ("L4", "L4-24GB", 23034, 121e12, 30.3e12, 300e9, 25e9),
    )
}


def profile_meta(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    layers: LayerSpec = "auto",
    *,
    modes: Sequence[str] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss_fn: LossFn | None = None,
    hardware: str = "H100",
    mfu: float = 0.5,
    bandwidth_efficiency: float = 0.7,
    free_grads_at_batch_start: bool | None = None,
    extrapolate: bool = True,
) -> Profile:
    """`profile_model` on the meta device, allocating nothing: memory and FLOPs exact, time estimated per segment as
    ``flops / (peak * mfu) + traffic / (hbm * bandwidth_efficiency)`` against ``HARDWARE[hardware]``."""
    if hardware not in HARDWARE:
        raise ProfileError(f"hardware: unknown {hardware!r}; valid: {', '.join(HARDWARE)}")
    for name, value in (("mfu", mfu), ("bandwidth_efficiency", bandwidth_efficiency)):
        if not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ProfileError(f"{name}: must be in (0, 1], got {value!r}")
    device = torch.device("meta")
    if not callable(model_factory):
        raise ProfileError(
            f"model_factory: expected a callable returning an nn.Module, got {type(model_factory).__name__}"
        )
    with device:
        model = model_factory()
    if not isinstance(model, nn.Module):
        raise ProfileError(f"model_factory: returned {type(model).__name__}, not an nn.Module")
    elsewhere = sorted({p.device.type for p in model.parameters()} - {"meta"})
    if elsewhere:
        raise ProfileError(
            f"model_factory: built parameters on {elsewhere}, not on meta; do not pass device= to the layers it builds"
        )
    mode_list = check_modes(modes)
    batch = tree_map(lambda t: torch.empty_like(t, device=device) if isinstance(t, torch.Tensor) else t, batch)
    model.train()
    hw = HARDWARE[hardware]
    dtypes = [p.dtype for p in model.parameters()]
    dtype = max(set(dtypes), key=dtypes.count)  # the peak FLOP/s of the most common parameter dtype
    peak = hw.flops.get(str(dtype).replace("torch.", ""), hw.flops["float32"])
    source = (
        f"estimated: FLOPs / ({hw.name} {str(dtype)[6:]} peak x mfu {mfu}) + traffic / (HBM x {bandwidth_efficiency})"
    )

    def run(spec: LayerSpec, run_modes: list[str]) -> Profile:
        session = ProfilingRun(model, batch, spec, run_modes, optimizer, loss_fn, device, free_grads_at_batch_start)
        try:
            mem = session.meter(run_modes)
        finally:
            remove_policy(model)
        return session.build(mem, None, source, hardware)

    prof = extrapolated(model, layers, mode_list, run) if extrapolate else run(layers, mode_list)
    by_mode = [prof.fixed, *(d for layer in prof.layers for d in (layer.fwd, layer.bwd))]
    for c in (c for d in by_mode for c in d.values()):
        c.seconds = (
            c.flops / (peak * mfu)
            + c.traffic / (hw.hbm_bytes_per_s * bandwidth_efficiency)
            + c.offload / hw.host_bytes_per_s
        )
    if Mode.OFFLOAD.value in mode_list:
        prof.notes.append(
            "offload: emulated on meta (saved tensors leave device memory in forward, return in backward)"
        )
    return prof
