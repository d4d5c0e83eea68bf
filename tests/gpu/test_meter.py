"""The meter: the callback's peak of a training step against the same step written by hand."""

from __future__ import annotations

from typing import Any

import torch

from lightning_recompute import RecomputePolicy, apply_policy
from lightning_recompute.callback import step_peak
from lightning_recompute.meter import StorageMeter
from lightning_recompute.reference import ReferenceGPT, SyntheticTokens
from tests.gpu.common import Device, data, layer_names, mixed, model, quiet, rel

METER_TOLERANCE = 0.005


def _reference_peak(net: ReferenceGPT, tokens: SyntheticTokens, policy: RecomputePolicy, device: torch.device) -> int:
    """The peak of the second training step written by hand, in Lightning's order, with the gradients
    freed at batch start (as the callback does): ``torch.cuda.max_memory_allocated`` on CUDA, the storage
    ledger on CPU. The second step is the first with the optimizer's state."""
    net.to(device).train()
    apply_policy(net, policy)
    optimizer = net.configure_optimizers()
    loader = iter(tokens.train_dataloader())
    peak = 0
    for step in range(2):
        batch = tuple(t.to(device) for t in next(loader))
        optimizer.zero_grad(set_to_none=True)
        meter: StorageMeter | None = None
        if step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            else:
                meter = StorageMeter(device)
                meter.track(net, optimizer, batch)
                meter.start()
        loss = net.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)  # Lightning's zero_grad between forward and backward
        loss.backward()
        del loss
        optimizer.step()
        if step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak = int(torch.cuda.max_memory_allocated(device))
            elif meter is not None:
                peak = meter.peak_bytes
                meter.close()
    return peak


def test_meter_peak_matches_the_allocator(device: Device, figures: dict[str, Any]) -> None:
    """`step_peak` (read by `CudaMemoryMeter` on CUDA) within 0.5% of ``torch.cuda.max_memory_allocated``
    around the same step written by hand, for none, selective, full, offload and a mixed policy on a model
    of a few hundred MB; on CPU the hand-written step is read by the storage ledger instead."""
    cfg, batch = device.sizes.model, device.sizes.batch
    policies = {m: RecomputePolicy.uniform(m) for m in ("none", "selective", "full", "offload")}
    policies["mixed"] = mixed(layer_names(cfg))
    figures["reference"] = "torch.cuda.max_memory_allocated" if device.cuda else "the storage ledger"
    figures["parameters"] = sum(p.numel() for p in model(cfg).parameters())
    rows: dict[str, dict[str, Any]] = {}
    figures["policies"] = rows
    for label, policy in policies.items():
        with quiet():
            # Gradients freed at batch start, as the hand-written step does (the callback's own choice here).
            meter = step_peak(
                model(cfg), data(cfg, batch), policy, accelerator=device.type, free_grads_at_batch_start=True
            )
            device.release()
            ref = _reference_peak(model(cfg), data(cfg, batch), policy, device.torch_device)
            device.release()
        rows[label] = {"meter_bytes": meter, "reference_bytes": ref, "rel_error": rel(meter, ref)}
    figures["worst_rel_error"] = worst = max(r["rel_error"] for r in rows.values())
    assert worst <= METER_TOLERANCE, f"meter vs {figures['reference']} beyond {METER_TOLERANCE:.1%}: {rows}"
    if not device.cuda:
        peaks = {k: v["meter_bytes"] for k, v in rows.items()}
        assert peaks["full"] < peaks["selective"] < peaks["none"] == peaks["offload"], peaks  # offload is none on CPU
