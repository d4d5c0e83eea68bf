"""Profiling without the hardware (`profile_meta`): memory on the meta device, time estimated against `HARDWARE`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_recompute import remove_policy
from lightning_recompute.layers import LayerSpec
from lightning_recompute.policy import Mode
from lightning_recompute.profile.extrapolate import profile_stack, stack_of
from lightning_recompute.profile.hardware import HARDWARE
from lightning_recompute.profile.measure import LossFn, ProfilingRun, Split, check_modes
from lightning_recompute.profile.model import Profile, ProfileError, SegmentCost
from lightning_recompute.profile.recorder import Recorder


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
    """The profile of a training step computed on the meta device: no tensor is allocated.

    Memory and FLOPs are exact for the ops as dispatched; time is an estimate,
    ``flops / (peak * mfu) + traffic / (hbm * bandwidth_efficiency)`` per segment plus ``offload`` host copies.

    Args:
        model_factory: builds the model (called once, under the meta device).
        batch: one micro-batch (only shapes and dtypes are used).
        layers: which modules are layers.
        modes: modes to profile (default: the base modes).
        optimizer: factory ``params -> optimizer`` (default: the model's ``configure_optimizers``, else AdamW).
        loss_fn: ``(model, batch) -> scalar loss``.
        hardware: a key of `HARDWARE`.
        mfu: fraction of peak FLOP/s matmuls reach (0 < mfu <= 1).
        bandwidth_efficiency: fraction of peak memory bandwidth elementwise ops reach.
        free_grads_at_batch_start: as for `profile_model`.
        extrapolate: profile a deep stack of identical layers from short cuts (`profile.extrapolate`).
    """
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
    mode_list = check_modes(modes, device)
    batch = tree_map(lambda t: torch.empty_like(t, device=device) if isinstance(t, torch.Tensor) else t, batch)
    model.train()
    hw = HARDWARE[hardware]
    dtypes = [p.dtype for p in model.parameters()]
    dtype = max(set(dtypes), key=dtypes.count)  # the peak FLOP/s of the most common parameter dtype
    peak = hw.flops.get(str(dtype).replace("torch.", ""), hw.flops["float32"])
    source = (
        f"estimated: FLOPs / ({hw.name} {str(dtype)[6:]} peak x mfu {mfu}) + traffic / (HBM x {bandwidth_efficiency})"
    )

    def estimate(c: SegmentCost) -> float:
        return (
            c.flops / (peak * mfu)
            + c.traffic / (hw.hbm_bytes_per_s * bandwidth_efficiency)
            + c.offload / hw.host_bytes_per_s
        )

    def run(spec: LayerSpec, run_modes: list[str]) -> Profile:
        session = ProfilingRun(model, batch, spec, run_modes, optimizer, loss_fn, device, free_grads_at_batch_start)
        try:
            session.warm_up()
            mem: dict[str, Recorder | Split] = {}
            for m in run_modes:
                mem[m] = session.memory_run(m, emulate_offload=(m == Mode.OFFLOAD.value))
        finally:
            remove_policy(model)
        return session.build(mem, None, source, hardware, estimate)

    prof: Profile | None = None
    stack = stack_of(model, layers) if extrapolate else None
    note: str | None = None
    if isinstance(stack, str):
        note = f"meta: every layer stepped ({stack})"
    elif stack is not None:
        # Explicit paths for the cut runs: "auto" could pick another, shorter stack there.
        prof, note = profile_stack(stack[0], stack[1], mode_list, run)
        if prof is not None:
            for layer in prof.layers:
                for c in (*layer.fwd.values(), *layer.bwd.values()):
                    c.seconds = estimate(c)
            for c in prof.fixed.values():
                c.seconds = estimate(c)
        else:
            note = f"meta: every layer stepped ({note})"
    if prof is None:
        prof = run(layers, mode_list)
    if note is not None:
        prof.notes.append(note)
    if Mode.OFFLOAD.value in mode_list:
        prof.notes.append(
            "offload: emulated on meta (saved tensors leave device memory in forward, return in backward)"
        )
    return prof
